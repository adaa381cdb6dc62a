"""Worker groups: the ranks (local processes or a Slurm job) launched by submitit, the rank loop, dispatch and
collect, the control channel, data handles, and what the controller asks Slurm."""
