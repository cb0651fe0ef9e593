"""A rule that reads the policy's JSON answer, as VeRL-with-RMs' rules do: the number in its
"Rule" field (0.0 when the completion is not a JSON object with one), so a test can choose each
sample's rule reward, 1 or partial credit such as 0.1."""

import json


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    try:
        return float(json.loads(solution_str)["Rule"])
    except (ValueError, KeyError, TypeError):
        return 0.0
