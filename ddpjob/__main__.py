"""`python -m ddpjob` is the same as the `ddpjob` console script."""

from ddpjob.cli import console

if __name__ == "__main__":
    console()
