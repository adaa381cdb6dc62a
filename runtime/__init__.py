"""Worker groups: the ranks (local processes or a Slurm job), their channel, data handles, the transfer protocols, and
the RLHF worker each rank runs."""
