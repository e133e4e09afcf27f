"""The in-memory snapshots' peer copies: what lets a restart resume from a snapshot when a node
and its /dev/shm are gone (memsnap.py holds each rank's own snapshots).

Under DDP the model, the optimizer and the samplers' global position are the same on every node;
only each rank's RNG streams are its own. So at each snapshot every rank's RNG file also goes,
in one gather, into the snapshot of one rank on another node (keepers()). At a restart the ranks
gather which verified snapshots each holds and plan_restore() picks the newest step at which
every new rank can have every file: from its own folder, else from a peer, sent over the
process group (fetch()) and checked against the holder's manifest digest before it is loaded
with weights_only=True. A rank on a spare node, which holds nothing, so gets the replicas from
rank 0 and its RNG from the rank that kept it: the run goes on bit-equal from the snapshot, not
from the older durable checkpoint. The gather costs O(world size) small objects per rank at each
snapshot (one RNG file is about 15 kB), and "auto" counts it in the snapshot's cost.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from typing import Any

from ddpjob.node import dist
from ddpjob.store.loadable import load_file
from ddpjob.store.memsnap import Snapshots
from ddpjob.store.source import Source


def keepers(hosts: list[str]) -> list[int | None]:
    """For each rank (its host at that index), the rank on another node whose snapshots keep a
    copy of its RNG file: the rank with the same index among the next node's ranks (nodes in
    the order of their first rank, cyclic). None for all when every rank is on one node: a lost
    node then loses the job's memory whole."""
    order = list(dict.fromkeys(hosts))
    if len(order) < 2:
        return [None] * len(hosts)
    ranks_on = {h: [r for r, x in enumerate(hosts) if x == h] for h in order}
    out: list[int | None] = []
    for rank, host in enumerate(hosts):
        nxt = ranks_on[order[(order.index(host) + 1) % len(order)]]
        out.append(nxt[ranks_on[host].index(rank) % len(nxt)])
    return out


@dataclass(frozen=True)
class Restore:
    """A restart's choice of snapshot: its step, and the files that travel between ranks (to,
    name, from) for the ranks whose own folder lacks them, in the order they are sent."""

    step: int
    fetch: list[tuple[int, str, int]]


def plan_restore(held: list[dict[int, list[str]]], needs: list[list[str]], durable: int | None) -> Restore | None:
    """The newest snapshot step, newer than the durable checkpoint `durable`, at which every rank
    R can get every file of `needs[R]`: from its own folder (`held[R]`: step -> the files its
    verified snapshot of that step holds) or else from the lowest rank that holds it (rank 0's
    replica first, whose buffers DDP broadcasts anyway). None when there is none. Pure: every
    rank computes the same plan from the same gathered lists."""
    for step in sorted({s for h in held for s in h}, reverse=True):
        if durable is not None and step <= durable:
            return None
        fetch = _fetches(step, held, needs)
        if fetch is not None:
            return Restore(step, fetch)
    return None


def _fetches(step: int, held: list[dict[int, list[str]]], needs: list[list[str]]) -> list[tuple[int, str, int]] | None:
    """(to, name, from) for every file a rank lacks at `step`; None when one is nowhere."""
    out = []
    for rank, names in enumerate(needs):
        for name in names:
            if name in held[rank].get(step, []):
                continue
            holder = next((h for h, hs in enumerate(held) if name in hs.get(step, [])), None)
            if holder is None:
                return None
            out.append((rank, name, holder))
    return out


def copies(snaps: Snapshots, rank: int, mine: Any, group: Any) -> dict[str, Any]:
    """Collective, at every snapshot step on every rank: `mine` (this rank's RNG file) to its
    keeper; returns the RNG files this rank keeps for others, as `rank-<Q>.pt`."""
    if snaps.keepers is not None and not any(k is not None for k in snaps.keepers):
        return {}  # every rank on one node (known since the first snapshot, alike on every rank)
    every = dist.all_gather_object((snaps.host, mine), what="the in-memory snapshot's peer copies", group=group)
    keep = snaps.keepers = keepers([host for host, _ in every])
    return {f"rank-{q}.pt": state for q, (_, state) in enumerate(every) if keep[q] == rank and q != rank}


def fetch(plan: Restore, held: list[dict[int, dict[str, Any]]], rank: int, snaps: Snapshots,
          group: Any) -> dict[str, bytes] | None:
    """Collective: the files of `plan` sent from their holders to the ranks without them, one
    after another in the plan's order (each pair meets at each file, so no rank waits on another
    pair). Returns what this rank received, each checked against its holder's manifest (size
    and sha256); None when one of them did not arrive whole."""
    got: dict[str, bytes] | None = {}
    for to, name, frm in plan.fetch:
        if rank not in (to, frm):
            continue
        entry = held[frm][plan.step]["files"][name]
        what = f"the copy of {name} (snapshot of step {plan.step}) from rank {frm} to rank {to}"
        if rank == frm:
            dist.send_bytes(snaps.read_bytes(plan.step, name, int(entry["size"])), to, group, what=what)
            continue
        data = dist.recv_bytes(frm, group, what=what)
        if got is not None and data and hashlib.sha256(data).hexdigest() == entry.get("sha256"):
            got[name] = data
        else:
            got = None  # still receive the rest: every pair's messages stay matched
    return got


def load_bytes(data: bytes, what: str) -> Any:
    """A file received by fetch(), loaded as a file is: weights_only=True."""
    return load_file(io.BytesIO(data), "cpu", what)


def newest(snaps: Snapshots, needs: list[str], durable: int | None, rank: int, control: dist.Control) -> Source | None:
    """Collective, at a resume: the newest snapshot, newer than the durable checkpoint `durable`,
    from which every rank can have all of its files (`needs`: this rank's), copied to the ranks
    whose own folder lacks them; None when there is none or a copy failed on any rank (all of
    them then resume from the durable checkpoint)."""
    from ddpjob.console import print0

    held = snaps.held()
    every = dist.all_gather_object((held, needs), what="the choice of an in-memory snapshot")
    helds = [h for h, _ in every]
    plan = plan_restore([{s: list(m.get("files", {})) for s, m in h.items()} for h in helds],
                        [n for _, n in every], durable)
    if plan is None:
        return None
    got = fetch(plan, helds, rank, snaps, control.group) if plan.fetch else {}
    if control.agree([int(got is None)], what="the copies of the snapshot's files")[0]:
        print0(f"the in-memory snapshot of step {plan.step} could not be copied whole between ranks: "
               "resuming from the durable checkpoint")
        return None
    assert got is not None
    to = sorted({r for r, _, _ in plan.fetch})
    print0(f"resuming from the in-memory snapshot of step {plan.step}, newer than any checkpoint"
           + (f" ({len(plan.fetch)} file(s) copied from peers to rank(s) {', '.join(map(str, to))}, "
              "whose node lost its own)" if to else ""))
    own = Source.of(snaps.store, snaps.info(plan.step)) if plan.step in held else None
    if not got:
        assert own is not None
        return own
    frm = next(f for r, _, f in plan.fetch if r == rank)
    where = f"the in-memory snapshot of step {plan.step} (copied from rank {frm})"

    def read(name: str) -> Any:
        if name in got:
            return load_bytes(got[name], f"{name} of {where}")
        assert own is not None
        return own.read(name)

    return Source(plan.step, helds[frm][plan.step], set(needs), read, f"in-memory snapshot {plan.step}", where)
