"""lab.energy against fake powercap trees (this machine, a KVM guest, has none)."""
import json
import os
import shutil

import pytest
from hypothesis import given, strategies as st

from lab import energy

MAX = 262_143_328_850   # a real package's max_energy_range_uj


def zone(root, folder, name, energy_uj=0, max_range=MAX):
    d = root / folder
    d.mkdir(parents=True)
    (d / "name").write_text(name + "\n")
    (d / "energy_uj").write_text(f"{energy_uj}\n")
    (d / "max_energy_range_uj").write_text(f"{max_range}\n")


def set_uj(root, folder, value):
    (root / folder / "energy_uj").write_text(f"{value}\n")


def make_tree(root, dram=True):
    """Two packages (dram subzones, a core subzone on package 1), plus zones to ignore."""
    zone(root, "intel-rapl:0", "package-0")
    zone(root, "intel-rapl:1", "package-1")
    zone(root, "intel-rapl:2", "psys")
    if dram:
        zone(root, "intel-rapl:0:0", "dram")
        zone(root, "intel-rapl:1:0", "dram")
    zone(root, "intel-rapl:1:1", "core")
    zone(root, "intel-rapl:1:2", "gpu")   # not a domain the report knows
    zone(root, "intel-rapl-mmio:0", "package-0", energy_uj=123)   # package-0 again, through MMIO
    return root


@pytest.fixture
def tree(tmp_path):
    return make_tree(tmp_path / "powercap")


def test_two_packages_with_dram(tree):
    meter = energy.Meter(tree)
    assert meter.available and meter.why == ""
    assert meter.domains == ["package-0", "dram-0", "package-1", "dram-1", "core-1"]
    before = meter.read()
    for folder, uj in [("intel-rapl:0", 1_500_000), ("intel-rapl:0:0", 250_000),
                       ("intel-rapl:1", 3_000_000), ("intel-rapl:1:0", 0), ("intel-rapl:1:1", 7)]:
        set_uj(tree, folder, uj)
    assert meter.joules(before, meter.read()) == {
        "package-0": 1.5, "dram-0": 0.25, "package-1": 3.0, "dram-1": 0.0, "core-1": 7e-6}
    assert energy.status(tree) == {"available": True, "why": "", "domains": meter.domains}


def test_counter_wrap(tmp_path):
    zone(tmp_path, "intel-rapl:0", "package-0", energy_uj=900, max_range=999)
    meter = energy.Meter(tmp_path)
    before = meter.read()
    set_uj(tmp_path, "intel-rapl:0", 100)   # 99 µJ to reach 999, 1 to reach 0, then 100
    assert meter.joules(before, meter.read()) == {"package-0": pytest.approx(200e-6, abs=1e-12)}


@pytest.fixture(scope="module")
def big_meter(tmp_path_factory):
    root = tmp_path_factory.mktemp("powercap")
    zone(root, "intel-rapl:0", "package-0")
    return energy.Meter(root)


@given(before=st.integers(0, MAX), used=st.integers(0, MAX))
def test_wrap_property(big_meter, before, used):
    after = (before + used) % (MAX + 1)
    got = big_meter.joules({"package-0": before}, {"package-0": after})["package-0"]
    assert abs(got - used / 1e6) < 0.5e-6   # exact to the µJ


def test_no_dram_subzone(tmp_path):
    meter = energy.Meter(make_tree(tmp_path, dram=False))
    assert meter.domains == ["package-0", "package-1", "core-1"]
    assert set(meter.read()) == {"package-0", "package-1", "core-1"}


def test_domain_gone_or_unreadable_between_reads(tree, monkeypatch):
    meter = energy.Meter(tree)
    before = meter.read()
    shutil.rmtree(tree / "intel-rapl:1:0")
    real = energy._read_int

    def read_int(path):
        if path.parent.name == "intel-rapl:1:1":
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(energy, "_read_int", read_int)
    after = meter.read()
    assert set(after) == {"package-0", "dram-0", "package-1"}
    assert set(meter.joules(before, after)) == {"package-0", "dram-0", "package-1"}
    del before["package-0"]   # absent from the first reading: left out too
    assert set(meter.joules(before, after)) == {"dram-0", "package-1"}


def assert_says_root(meter, tree):
    assert not meter.available and meter.domains == [] and meter.read() == {}
    assert str(tree / "intel-rapl:0" / "energy_uj") in meter.why
    assert "root" in meter.why and "CVE-2020-8694" in meter.why and "chmod o+r" in meter.why
    assert "\n" not in meter.why


def test_energy_uj_readable_only_by_root_simulated(tree, monkeypatch):
    real = energy._read_int

    def read_int(path):
        if path.name == "energy_uj":
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(energy, "_read_int", read_int)
    assert_says_root(energy.Meter(tree), tree)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a chmod 000 file anyway; the simulated test covers it")
def test_energy_uj_readable_only_by_root_chmod(tree):
    for f in tree.glob("*/energy_uj"):
        f.chmod(0)
    assert_says_root(energy.Meter(tree), tree)


def test_no_powercap_folder(tmp_path):
    meter = energy.Meter(tmp_path / "powercap")
    assert not meter.available and meter.domains == [] and meter.read() == {}
    assert meter.why.startswith(f"no {tmp_path / 'powercap'}")
    assert meter.measure(lambda x: x + 1, 41) == (42, {})


def test_no_rapl_zones(tmp_path):
    zone(tmp_path, "intel-rapl-mmio:0", "package-0")
    zone(tmp_path, "intel-rapl:0", "psys")
    meter = energy.Meter(tmp_path)
    assert not meter.available and "no RAPL" in meter.why and "virtual machine" in meter.why


def test_measure_reads_around_the_call(tree):
    result, joules = energy.Meter(tree).measure(lambda: set_uj(tree, "intel-rapl:1", 2_000_000) or "done")
    assert result == "done"
    assert joules == {"package-0": 0.0, "dram-0": 0.0, "package-1": 2.0, "dram-1": 0.0, "core-1": 0.0}


def test_this_machine_status_is_clean():
    s = energy.status()
    assert set(s) == {"available", "why", "domains"}
    assert json.loads(json.dumps(s)) == s
    assert s["available"] == bool(s["domains"]) and (s["why"] == "") == s["available"]
