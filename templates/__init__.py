"""The sbatch template shipped with ddpjob (read through importlib.resources by ddpjob.launch.render)."""
