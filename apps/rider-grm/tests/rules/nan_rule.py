"""A rule that returns NaN for odd-length responses (a rule bug): those samples must fail, not
pass every gate (NaN < threshold is false) and poison the reward."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float("nan") if len(solution_str) % 2 else 1.0
