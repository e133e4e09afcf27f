"""job.user: the job file's [user] table as the user's script reads it. A missing key names the
keys that are there (MissingUserKey: the user's mistake, though raised from ddpjob), and every
key the script asks for is noted, for the first checkpoint's line on keys never read (a typo in
the job file would otherwise do nothing, silently).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class MissingUserKey(KeyError):
    """job.user[key] of a key the [user] table lacks: the user's mistake, raised from ddpjob."""


class UserTable(dict):
    """job.user, the job file's [user] table: a key that is not there names the ones that are.
    It records the keys the script asked for (`read`, present or not; a whole-table read such as
    `**job.user` reads them all), for the first checkpoint's line on keys never read."""

    def __init__(self, table: Any) -> None:
        super().__init__(table)
        self.read: set[str] = set()

    def __getitem__(self, key: Any) -> Any:
        self.read.add(str(key))
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self.read.add(str(key))
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return super().__contains__(key)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        self.read.add(str(key))
        return super().setdefault(key, default)

    def pop(self, key: Any, *default: Any) -> Any:
        self.read.add(str(key))
        return super().pop(key, *default)

    def _all(self) -> None:
        self.read.update(map(str, dict.keys(self)))

    def __iter__(self) -> Iterator[Any]:
        self._all()
        return super().__iter__()

    def keys(self) -> Any:
        self._all()
        return super().keys()

    def items(self) -> Any:
        self._all()
        return super().items()

    def values(self) -> Any:
        self._all()
        return super().values()

    def __missing__(self, key: Any) -> Any:
        raise MissingUserKey(f"{key!r} is not in the job file's [user] table, which has: "
                             f"{', '.join(sorted(map(str, self))) or 'nothing'}")
