"""A rule the tiny policy can learn: the fraction of completion characters that are the letter 'e'."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(ch == "e" for ch in solution_str) / max(len(solution_str), 1)
