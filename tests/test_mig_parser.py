"""The MIG inventory parser (pure): every real capture, the join, and hostile text."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gputop.model import GpuInfo, ProcessInfo
from gputop.sources import mig
from gputop.ssh.transport import ParseError

DATA = Path(__file__).parent / "data" / "nvidia-smi"
MIXED_L = (DATA / "table/list-L-h100-80gb-hbm3-mig-mixed-profiles-driver-590.48.01.txt").read_text()
X8_L = (DATA / "table/list-L-h100-80gb-hbm3-x8-mig-1g.10gb.txt").read_text()
A100_40 = (DATA / "xml/a100-sxm4-40gb-mig-driver-510.47.03.xml").read_text()
A100_80 = (DATA / "xml/a100-sxm4-80gb-mig-driver-535.54.03.xml").read_text()
A100_80_UUID = "GPU-513536b6-7d19-9063-b049-1e69664bb298"


@pytest.mark.parametrize("path", sorted(p for p in DATA.rglob("*") if p.is_file()
                                        and p.name != "SOURCES.md"), ids=lambda p: p.name)
def test_every_capture_gives_the_instances_it_holds(path: Path) -> None:
    """Counted from each capture's text line by line: its ``-L`` GPUs and MIG lines, its
    ``-q -x`` GPUs and ``<mig_device>`` elements. The inventory holds exactly those
    instances, given the capture as both kinds (the other kind is one warning, no crash)."""
    text = path.read_text(errors="replace")
    lines = text.splitlines()
    listed_gpus = sum(ln.startswith("GPU ") and "(UUID: GPU-" in ln for ln in lines)
    listed_migs = sum(ln.lstrip().startswith("MIG ") and " Device " in ln
                      and "(UUID: MIG-" in ln for ln in lines)
    xml_gpus, xml_migs = text.count("<gpu id="), text.count("<mig_device>")
    listed = mig.parse_list(text)
    assert len(listed) == listed_gpus
    assert sum(map(len, listed.values())) == listed_migs
    inv = mig.build_inventory(text, text)
    assert sum(map(len, inv.devices.values())) == listed_migs + xml_migs
    if text.startswith("<?xml"):
        assert inv.warnings == () and len(inv.placement) == xml_gpus
    else:
        assert len(inv.warnings) == 1 and inv.warnings[0].startswith("MIG inventory:")


def test_list_with_mixed_profiles() -> None:
    (gpu, devs), = mig.parse_list(MIXED_L).items()
    assert gpu == "GPU-00000000-0000-0000-0000-000000000000"
    assert [(d.device_index, d.profile) for d in devs] == [
        (0, "3g.40gb"), (1, "2g.20gb"), (2, "1g.10gb"), (3, "1g.10gb")]
    assert devs[3].uuid == "MIG-00000003-0000-0000-0000-000000000003"
    assert devs[0].gpu_instance_id is None  # -L does not say; -q -x does


def test_list_of_eight_gpus_with_seven_instances_each() -> None:
    listed = mig.parse_list(X8_L)
    assert len(listed) == 8 and all(len(d) == 7 for d in listed.values())
    first = listed["GPU-63d1e50a-b952-d15c-0740-12bc14859142"]
    assert first[6].uuid == "MIG-f9cebd56-fdb1-5f90-a05d-d4abf0512ae9"
    assert {d.profile for ds in listed.values() for d in ds} == {"1g.10gb"}


def test_old_mig_uuid_format_names_its_ids() -> None:
    text = ("GPU 0: A100-SXM4-40GB (UUID: GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77)\n"
            "  MIG 1g.5gb Device 0: (UUID: MIG-GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77/7/0)\n")
    (d,), = mig.parse_list(text).values()
    assert (d.gpu_instance_id, d.compute_instance_id, d.profile) == (7, 0, "1g.5gb")


def test_xml_mig_devices_of_two_drivers() -> None:
    devs, placement, warnings = mig.parse_xml(A100_40)
    (d40,) = devs.values()
    assert [(d.device_index, d.gpu_instance_id, d.compute_instance_id) for d in d40] == [
        (0, 1, 0), (1, 2, 0)]
    assert (d40[0].memory_used_mib, d40[0].memory_total_mib) == (19, 19968)
    assert warnings == [] and all(p == {} for p in placement.values())
    devs, _, _ = mig.parse_xml(A100_80)
    assert [d.gpu_instance_id for d in devs[A100_80_UUID]] == [3, 4, 5, 6]


def test_join_by_gpu_and_device_index() -> None:
    listed = (f"GPU 0: NVIDIA A100-SXM4-80GB (UUID: {A100_80_UUID})\n"
              + "".join(f"  MIG 1g.20gb     Device  {i}: (UUID: MIG-{i:08d}-aaaa)\n"
                        for i in range(4)))
    inv = mig.build_inventory(listed, A100_80)
    devs = inv.devices[A100_80_UUID]
    assert [(d.profile, d.gpu_instance_id, d.memory_total_mib, d.uuid) for d in devs][1] == (
        "1g.20gb", 4, 19968, "MIG-00000001-aaaa")
    assert inv.parents["MIG-00000002-aaaa"] == (A100_80_UUID, 5, 0)


def _with_processes(blocks: str) -> str:
    return A100_80.replace("        <processes />", f"        <processes>\n{blocks}"
                           "        </processes>")


def _proc(pid: int, gi: int, name: str = "python") -> str:
    return (f"            <process_info>\n"
            f"                <gpu_instance_id>{gi}</gpu_instance_id>\n"
            f"                <compute_instance_id>0</compute_instance_id>\n"
            f"                <pid>{pid}</pid>\n                <type>C</type>\n"
            f"                <process_name>{name}</process_name>\n"
            f"                <used_memory>100 MiB</used_memory>\n"
            f"            </process_info>\n")


def test_placement_from_process_info() -> None:
    _, placement, _ = mig.parse_xml(_with_processes(_proc(100, 3) + _proc(200, 6)))
    assert placement[A100_80_UUID] == {100: (3, 0), 200: (6, 0)}


def test_a_forged_process_block_hides_a_placement_never_moves_it() -> None:
    """A name that closes its element and forges another block for pid 100 on instance 6:
    pid 100 is then on two instances, so on none; pid 200's placement stands."""
    forged = ("x</process_name>\n<used_memory>1 MiB</used_memory>\n</process_info>\n"
              "<process_info>\n<gpu_instance_id>6</gpu_instance_id>\n"
              "<compute_instance_id>0</compute_instance_id>\n<pid>100</pid>\n<type>C\n"
              "</type>\n<process_name>y")
    for order in ((_proc(100, 3), _proc(300, 4, forged)), (_proc(300, 4, forged), _proc(100, 3))):
        _, placement, warnings = mig.parse_xml(_with_processes("".join(order) + _proc(200, 6)))
        assert placement[A100_80_UUID].get(100) is None
        assert placement[A100_80_UUID][200] == (6, 0)
        assert any("pid 100 listed on two instances" in w for w in warnings)


def test_a_forged_gpu_element_rejects_the_document() -> None:
    forged = (f"x</process_name>\n</process_info>\n</processes>\n</gpu>\n<gpu id=\"f\">\n"
              f"<uuid>{A100_80_UUID}</uuid>\n<mig_devices>\n<mig_device>\n<index>0</index>\n"
              "<gpu_instance_id>13</gpu_instance_id>\n</mig_device>\n</mig_devices>\n"
              "<processes>\n<process_info>\n<pid>1</pid>\n<process_name>y")
    with pytest.raises(ParseError, match="twice"):
        mig.parse_xml(_with_processes(_proc(300, 4, forged)))
    # The inventory then keeps what -L says, and says why.
    listed = f"GPU 0: X (UUID: {A100_80_UUID})\n  MIG 1g.20gb Device 0: (UUID: MIG-1)\n"
    inv = mig.build_inventory(listed, _with_processes(_proc(300, 4, forged)))
    (d,) = inv.devices[A100_80_UUID]
    assert (d.profile, d.gpu_instance_id) == ("1g.20gb", None)
    assert any("twice" in w for w in inv.warnings)


@pytest.mark.parametrize("name", [
    "a&b<c>", "</process_name></process_info></processes></gpu></nvidia_smi_log>",
    "\x1b]0;pwned\x07", '<!ENTITY x "y">&x;', "]]><![CDATA[", "<?xml version='1.0'?>",
])
def test_hostile_names_are_inert(name: str) -> None:
    _, placement, _ = mig.parse_xml(_with_processes(_proc(100, 3, name) + _proc(200, 6)))
    assert placement[A100_80_UUID][200] == (6, 0)


def test_entities_are_never_expanded() -> None:
    """An internal DTD (a billion-laughs bomb) is not nvidia-smi's one-line DOCTYPE: the
    document is refused, saying why, before anything is expanded; the inventory keeps what
    -L says."""
    laughs = "".join(f'<!ENTITY l{i} "{f"&l{i - 1};" * 10}">' for i in range(1, 10))
    bomb = A100_80.replace('<!DOCTYPE nvidia_smi_log SYSTEM "nvsmi_device_v12.dtd">',
                           f'<!DOCTYPE nvidia_smi_log [<!ENTITY l0 "lol">{laughs}]>')
    bomb = bomb.replace("<timestamp>", "<timestamp>&l9;")
    with pytest.raises(ParseError, match="internal subset"):
        mig.parse_xml(bomb)
    one_line = bomb.replace("\n", "")  # (and no line-dropping fallback lets it through)
    with pytest.raises(ParseError, match="internal subset"):
        mig.parse_xml(one_line)
    listed = f"GPU 0: X (UUID: {A100_80_UUID})\n  MIG 1g.20gb Device 0: (UUID: MIG-1)\n"
    inv = mig.build_inventory(listed, bomb)
    assert [d.profile for d in inv.devices[A100_80_UUID]] == ["1g.20gb"]
    assert any("refused" in w and "internal subset" in w for w in inv.warnings)


def test_tags_sharing_lines_parse_as_one_per_line() -> None:
    """Valid XML laid out otherwise (all on one line; several tags per line) is the same
    document: the same instances and placement, and no "malformed line" warning."""
    doc = _with_processes(_proc(100, 3) + _proc(200, 6))
    expected = mig.parse_xml(doc)
    assert len(expected[0][A100_80_UUID]) == 4 and expected[2] == []
    one_line = re.sub(r">\s*\n\s*<", "><", doc)
    assert one_line.count("\n") <= 2
    paired = re.sub(r"(</[a-z_]+>)\s*\n\s*(<[a-z_]+>)", r"\1 \2", doc)
    for text in (one_line, paired):
        assert mig.parse_xml(text) == expected
        inv = mig.build_inventory(None, text)
        assert inv.warnings == () and len(inv.devices[A100_80_UUID]) == 4


@pytest.mark.parametrize("doc, why", [
    ("<nvidia_smi_log><gpu><uuid>GPU-1</uuid>", "not well-formed"),
    ("<nvidia_smi_log>" + "<gpu>" * 1000, "not well-formed"),
    ("<nvidia_smi_log>" + " " * (8 * 1024 * 1024 + 1) + "</nvidia_smi_log>", "larger than"),
    ('<!DOCTYPE x [<!ENTITY e SYSTEM "file:///etc/passwd">]><x>&e;</x>', "internal subset"),
    ("<nvidia_smi_log>\udcff</nvidia_smi_log>", "not well-formed"),
], ids=["unclosed", "deep-unclosed", "huge", "external-entity", "undecodable"])
def test_hostile_documents_are_refused_with_a_reason(doc: str, why: str) -> None:
    with pytest.raises(ParseError, match=why):
        mig.parse_xml(doc)
    inv = mig.build_inventory(None, doc)  # what the poller calls: a warning, never a crash
    assert inv.devices == {} and any(why in w for w in inv.warnings)


def test_attach_places_processes_and_leaves_utilisation_unknown() -> None:
    inv = mig.build_inventory(
        f"GPU 0: A (UUID: {A100_80_UUID})\n"
        + "".join(f"  MIG 1g.20gb Device {i}: (UUID: MIG-{i})\n" for i in range(4)),
        _with_processes(_proc(100, 3)))
    g = GpuInfo(index=0, uuid=A100_80_UUID, mig_mode="Enabled",
                processes=(ProcessInfo(100, "alice"), ProcessInfo(101, "bob")))
    (out,) = mig.attach([g], inv)
    assert [len(i.processes) for i in out.instances] == [1, 0, 0, 0]
    assert out.instances[0].users == ("alice",)
    assert all(i.utilization_percent is None for i in out.instances)
    # pid 101 is not in the inventory: the refresh says so (read it again, soon).
    assert mig.unknown([out], inv)
    assert not mig.unknown([g.__class__(index=0, uuid=A100_80_UUID, mig_mode="Enabled",
                                        processes=(ProcessInfo(100),))], inv)
    assert mig.unknown([], inv, ["MIG-unknown"])
    # Not MIG: untouched.
    plain = GpuInfo(index=1, uuid="GPU-x", mig_mode="Disabled")
    assert mig.attach([plain], inv) == [plain]
