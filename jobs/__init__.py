"""Example job files shipped with ddpjob (`ddpjob sbatch smoke` finds them when no local file matches)."""
