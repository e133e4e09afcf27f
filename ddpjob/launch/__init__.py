"""Login side: render, submit and watch jobs (sbatch, submitit, the local backend), doctor, data
preparation and plots. Nothing here imports torch at import time."""
