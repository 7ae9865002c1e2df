"""Energy per token where the CPU exposes it: the Linux powercap RAPL counters.

RAPL (Running Average Power Limit) zones under /sys/class/powercap count the energy each
CPU package, and inside it the DRAM (and on some CPUs the cores and the uncore), has
used: `energy_uj`, in microjoules, which starts again at 0 after `max_energy_range_uj`.
Two readings around a run give its joules; divided by the tokens made, energy per token,
a cost that time alone hides when drafter and target keep different numbers of cores busy.

Where energy cannot be read (no powercap, no RAPL zones as in most virtual machines,
counters readable only by root) a Meter says why instead of raising: energy is an extra
column in a report, not something a run needs.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path("/sys/class/powercap")
UJ_PER_J = 1_000_000

# Zone folders as the kernel names them, <control type>:<package>[:<subzone>];
# intel-rapl-mmio:N is package N again through another interface, so it does not match.
_ZONE = re.compile(r"(?:intel|amd)-rapl:(\d+)(?::(\d+))?")
# Multi-die packages are named package-N-die-M.
_PACKAGE = re.compile(r"package-(\d+(?:-die-\d+)?)")
_SUBZONES = {"dram", "core", "uncore"}


@dataclass(frozen=True)
class Domain:
    name: str       # "package-0", "dram-0", ...
    counter: Path   # its energy_uj
    wrap: int       # max_energy_range_uj + 1: the counter counts modulo this


def _read_int(path: Path) -> int:
    return int(path.read_text().strip())


def _name(zone: Path) -> str | None:
    try:
        return (zone / "name").read_text().strip()
    except OSError:
        return None


def _zones(root: Path) -> list[Path]:
    """RAPL zone folders under root, each package before its subzones."""
    found = []
    for entry in root.iterdir():
        m = _ZONE.fullmatch(entry.name)
        if m:
            found.append(([int(g) for g in m.groups() if g is not None], entry))
    return [zone for _, zone in sorted(found)]


def _domain_name(zone: Path) -> str | None:
    """The domain's name: package-N for a package zone, dram-N (core-N, uncore-N) for
    its subzones, None for a zone not reported (psys, or a name that cannot be read)."""
    name = _name(zone)
    if zone.name.count(":") == 1:
        return name if name and _PACKAGE.fullmatch(name) else None
    parent = _name(zone.with_name(zone.name.rsplit(":", 1)[0]))
    m = _PACKAGE.fullmatch(parent or "")
    return f"{name}-{m.group(1)}" if m and name in _SUBZONES else None


class Meter:
    """The RAPL domains of this machine: read() before and after, joules() between."""

    def __init__(self, root: Path = ROOT):
        self.root = Path(root)
        self._domains: dict[str, Domain] = {}   # by name: a zone seen twice is one domain
        self.why = self._discover()

    @property
    def available(self) -> bool:
        return bool(self._domains)

    @property
    def domains(self) -> list[str]:
        return list(self._domains)

    def _discover(self) -> str:
        """Fill self._domains with the readable domains; return why energy is not
        reported, or "" when it is."""
        if not self.root.is_dir():
            return f"no {self.root}: this kernel exposes no powercap interface"
        try:
            zones = _zones(self.root)
        except OSError as e:
            return f"cannot list {self.root}: {e.strerror}"
        denied = None
        for zone in zones:
            name = _domain_name(zone)
            if name is None:
                continue
            try:
                _read_int(zone / "energy_uj")
                wrap = _read_int(zone / "max_energy_range_uj") + 1
            except PermissionError as e:
                denied = denied or Path(e.filename or zone / "energy_uj")
                continue
            except (OSError, ValueError):
                continue
            self._domains[name] = Domain(name, zone / "energy_uj", wrap)
        if self._domains:
            return ""
        if denied:
            return (f"{denied} is readable only by root (Linux restricted the RAPL counters "
                    f"in 2020, CVE-2020-8694): run as root, or open them to all until reboot "
                    f"with `sudo chmod o+r {self.root}/*-rapl:*/energy_uj`")
        return f"no RAPL package zones in {self.root} (a virtual machine usually has none)"

    def read(self) -> dict[str, int]:
        """Each domain's counter now, in µJ; a domain that cannot be read is left out."""
        out = {}
        for d in self._domains.values():
            try:
                out[d.name] = _read_int(d.counter)
            except (OSError, ValueError):
                pass   # gone or unreadable: no number is better than a wrong one
        return out

    def joules(self, before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
        """Joules used between two read()s, per domain present in both.

        A later reading below an earlier one has wrapped once; more than one wrap cannot
        be seen, so read at least once per wrap period (minutes to hours at full power)."""
        return {name: ((after[name] - before[name]) % d.wrap) / UJ_PER_J
                for name, d in self._domains.items() if name in before and name in after}

    def measure(self, fn: Callable[..., Any], *args, **kwargs) -> tuple[Any, dict[str, float]]:
        """Call fn(*args, **kwargs) -> (its result, joules per domain it used)."""
        before = self.read()
        result = fn(*args, **kwargs)
        return result, self.joules(before, self.read())


def status(root: Path = ROOT) -> dict:
    """Whether energy is reported here, for a report's JSON."""
    meter = Meter(root)
    return {"available": meter.available, "why": meter.why, "domains": meter.domains}
