"""A deliberately slow rule (20 ms a sample), served as a judge's reward: a judge whose scoring
takes long enough that overlapping it with the rollout shows."""

import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(0.02)
    return len(solution_str) % 7 / 7
