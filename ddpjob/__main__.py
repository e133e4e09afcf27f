"""`python -m ddpjob` is the same as the `ddpjob` console script. A rank's `python -m ddpjob run`
notes a stop signal from its first line on (earlysignals.py), before the imports."""

import sys

if __name__ == "__main__" and sys.argv[1:2] == ["run"]:
    from ddpjob import earlysignals

    earlysignals.hold()

from ddpjob.cli import console  # noqa: E402

if __name__ == "__main__":
    console()
