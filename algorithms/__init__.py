"""The RLHF algorithms: advantage estimators (estimators), KL (kl), Safe-RLHF's Lagrangian (lagrangian), policy and
value losses (losses), the advantage stage, DAPO's dynamic sampling, and the one iteration function both the flow and
the trainer run."""
