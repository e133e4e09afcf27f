"""`python -m ddpjob` is the same as the `ddpjob` console script."""

from ddpjob.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
