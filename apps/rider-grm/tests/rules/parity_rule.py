"""A verl-style rule that passes about half the samples, to exercise the judge gate."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str) % 2 == 0)
