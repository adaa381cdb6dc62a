"""Cost functions for Safe-RLHF (``reward.cost_function``), with the custom reward's signature.

The main job's task wants a number; every character past a short answer is verbosity, a stand-in for the harm
signal a real cost model would give. Safe-RLHF keeps the mean episode cost under ``algorithm.cost_limit``.
"""


def verbosity_cost(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """The response's characters beyond 8, in hundreds: 0 for a bare answer, 0.5 for 58 characters."""
    return max(0, len(solution_str) - 8) / 100
