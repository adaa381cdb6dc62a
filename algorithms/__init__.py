"""The RLHF algorithms: advantage estimators and policy losses (core_algos), the advantage stage, DAPO's dynamic
sampling, and the one iteration function both the flow and the trainer run."""
