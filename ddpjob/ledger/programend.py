"""What a [train] command's program did about ddpjob's stop signal: the stop record's `program`
field (rank/command_end.py decides it from the program's end) and the words the rank's log,
`ddpjob status` and the docs say for it: "saved" only where it exited by itself."""

from __future__ import annotations

EXITED, DIED, KILLED, PEER_GONE = "exited", "died", "killed", "peer_gone"


def stop_said(program: str | None, signal_name: str = "the stop signal", grace_s: float | None = None) -> str:
    """What the program did about the stop, in the words status and the log use."""
    if program == EXITED:
        return f"the program exited by itself after {signal_name}: it resumes from what it saved"
    if program == DIED:
        return f"the program had no handler: it died of {signal_name}; what it saved last is what resumes"
    if program == KILLED:
        grace = "" if grace_s is None else f" {grace_s:.0f} s"
        return (f"the program did not exit within the{grace} grace after {signal_name}: killed; what it "
                "saved last is what resumes")
    if program == PEER_GONE:
        return "the program ended when a peer that stopped first left its process group; what it saved last is what resumes"
    return ""
