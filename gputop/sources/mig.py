"""MIG inventory: which instances each GPU is split into, and which process runs on which.

Pure (text in, records out). Two real outputs are read:

- ``nvidia-smi -L``: per GPU its MIG devices, each with its profile (``3g.40gb``) and MIG
  uuid. No user-chosen text is in it.
- ``nvidia-smi -q -x``: per GPU its ``<mig_devices>`` (GPU / compute instance ids, memory)
  and, per process, ``gpu_instance_id`` / ``compute_instance_id``. It is parsed as XML
  (expat, however its tags are laid out on lines), bounded in size, and a DOCTYPE with
  an internal subset (entity declarations: a billion-laughs bomb) refuses the document:
  nothing is ever expanded. ``<process_name>`` is text a user chooses (argv[0]), printed
  unescaped: it can break the XML or forge elements. So each one's text is blanked before
  parsing (it is never used); where a name still breaks the document, lines that are not
  one well-formed element are dropped and it is parsed again. Two ``<gpu>`` elements with
  one uuid reject the whole document, and a pid placed on two instances is placed on
  none. A forged entry can therefore hide a placement, never invent one for a process
  that ``--query-compute-apps`` (which holds no user text) does not list.

The per-refresh query reports a MIG GPU's processes under the parent GPU's uuid (some
drivers: under the MIG device's uuid); the inventory says on which instance each runs.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from xml.parsers import expat

from gputop.model import GpuInfo, MigInstance
from gputop.ssh.transport import ParseError
from gputop.text import clean, excerpt

_GPU_LINE = re.compile(r"GPU (\d{1,4}): (.{0,200}) \(UUID: (GPU-[0-9A-Za-z-]{1,64})\)")
_MIG_LINE = re.compile(
    r"\s+MIG (\S{1,40})\s+Device\s+(\d{1,3}): \(UUID: (MIG-[0-9A-Za-z/-]{1,100})\)")
#: Drivers before R470 named a MIG device ``MIG-GPU-<gpu uuid>/<GI>/<CI>``.
_OLD_MIG_UUID = re.compile(r"MIG-GPU-[0-9A-Za-z-]+/(\d{1,3})/(\d{1,3})")


@dataclass(frozen=True)
class MigDevice:
    """One MIG device (a compute instance inside a GPU instance) of one GPU."""

    device_index: int | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    uuid: str | None = None
    profile: str | None = None
    memory_used_mib: int | None = None
    memory_total_mib: int | None = None


@dataclass(frozen=True)
class Inventory:
    """MIG devices per parent GPU uuid, and (GI, CI) per pid per parent GPU uuid."""

    devices: dict[str, tuple[MigDevice, ...]] = field(default_factory=dict)
    placement: dict[str, dict[int, tuple[int, int]]] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()

    @property
    def parents(self) -> dict[str, tuple[str, int | None, int | None]]:
        """MIG uuid -> (parent GPU uuid, GPU instance id, compute instance id)."""
        return {d.uuid: (gpu, d.gpu_instance_id, d.compute_instance_id)
                for gpu, devs in self.devices.items() for d in devs if d.uuid}


def parse_list(text: str) -> dict[str, list[MigDevice]]:
    """``nvidia-smi -L``: MIG devices per GPU uuid (a GPU without MIG: an empty list).

    Lines that are neither a GPU nor a MIG line (a lost GPU's message) are skipped."""
    out: dict[str, list[MigDevice]] = {}
    current: list[MigDevice] | None = None
    for line in text.splitlines():
        line = line.rstrip()
        m = _GPU_LINE.fullmatch(line)
        if m:
            current = out.setdefault(m.group(3), [])
            continue
        m = _MIG_LINE.fullmatch(line)
        if m and current is not None:
            uuid = m.group(3)
            old = _OLD_MIG_UUID.fullmatch(uuid)
            current.append(MigDevice(
                device_index=int(m.group(2)), profile=clean(m.group(1)), uuid=uuid,
                gpu_instance_id=int(old.group(1)) if old else None,
                compute_instance_id=int(old.group(2)) if old else None))
        elif not line.startswith((" ", "\t")):
            current = None  # a MIG line belongs to the GPU line right above it only
    return out


# One element per line, as nvidia-smi prints them; anything else is not its own output.
_XML_LINE = re.compile(
    r'\s*(?:<\?xml [^<>]*\?>|<!DOCTYPE [A-Za-z_]+ SYSTEM "[\w.-]+">'
    r'|<[A-Za-z_0-9]+(?: [a-z_]+="[^"<>&]*")*>[^<>&]*(?:</[A-Za-z_0-9]+>)?'
    r"|</[A-Za-z_0-9]+>|<[A-Za-z_0-9]+ ?/>|[^<>&]*)\s*")
_NUM = re.compile(r"\s*(\d{1,9})(?:\s*MiB)?\s*")
#: What XML 1.0 does not allow in a document, and a user can put in a process name.
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ufffe\uffff]")


#: Larger than any real ``-q -x`` (8 GPUs with many processes: well under 1 MiB); the
#: remote read stops at the same size (gputop.sources.ssh).
MAX_XML_CHARS = 8 * 1024 * 1024
#: A process name's element, up to its first closing tag (the name itself may hold one).
_PROCESS_NAME = re.compile(r"<process_name>.*?</process_name>", re.DOTALL)
_CHUNK = 64 * 1024


class _Refused(Exception):
    """A document that is refused, not retried: an internal DTD (entities), too large."""


def parse_document(text: str) -> ET.Element:
    """``text`` as an XML tree, by expat fed a chunk at a time. An internal DTD subset or
    an entity declaration is refused (no entity is ever defined, so none is expanded; an
    external DTD is never read); a document that is not well-formed is a ParseError."""
    builder = ET.TreeBuilder()
    parser = expat.ParserCreate()
    parser.SetParamEntityParsing(expat.XML_PARAM_ENTITY_PARSING_NEVER)

    def doctype(name: str, sysid: str | None, pubid: str | None, internal: int) -> None:
        if internal:
            raise _Refused("it declares a DOCTYPE with an internal subset (entities), "
                           "which nvidia-smi never prints")

    def entity(*_: object) -> None:
        raise _Refused("it declares an entity, which nvidia-smi never prints")

    def start(tag: str, attrs: dict[str, str]) -> None:
        builder.start(tag, attrs)

    def end(tag: str) -> None:
        builder.end(tag)

    parser.StartDoctypeDeclHandler = doctype
    parser.EntityDeclHandler = entity
    parser.UnparsedEntityDeclHandler = entity
    parser.StartElementHandler = start
    parser.EndElementHandler = end
    parser.CharacterDataHandler = builder.data
    try:
        for at in range(0, len(text), _CHUNK):
            parser.Parse(text[at:at + _CHUNK], False)
        parser.Parse("", True)
    except (expat.ExpatError, ValueError) as exc:  # (ValueError: text that is not UTF-8)
        raise ParseError(f"nvidia-smi -q -x is not well-formed XML: {excerpt(str(exc))}"
                         ) from None
    return builder.close()


def _int(e: ET.Element | None, tag: str) -> int | None:
    node = e.find(tag) if e is not None else None
    m = _NUM.fullmatch(node.text or "") if node is not None else None
    return int(m.group(1)) if m else None


def parse_xml(text: str) -> tuple[dict[str, list[MigDevice]], dict[str, dict[int, tuple[int, int]]],
                                  list[str]]:
    """``nvidia-smi -q -x``: MIG devices and process placement per GPU uuid, and warnings.

    Raises ParseError for a document that is refused (too large, an internal DTD), is not
    nvidia-smi's (also after dropping lines that are not one element each) or names a GPU
    twice.
    """
    if len(text) > MAX_XML_CHARS:
        raise ParseError(f"nvidia-smi -q -x: document larger than {MAX_XML_CHARS >> 20} MiB: "
                         "refused")
    dropped = 0
    try:
        root = parse_document(_PROCESS_NAME.sub("<process_name></process_name>",
                                                _CONTROL.sub(" ", text)))
    except _Refused as exc:
        raise ParseError(f"nvidia-smi -q -x refused: {exc}") from None
    except ParseError:
        # A process name that still breaks the document: keep the lines that are one
        # well-formed element each (nvidia-smi prints one per line) and try once more.
        kept = [ln for ln in text.splitlines()
                if _XML_LINE.fullmatch(ln) and not _CONTROL.search(ln)]
        dropped = len(text.splitlines()) - len(kept)
        try:
            root = parse_document("\n".join(kept))
        except _Refused as exc:
            raise ParseError(f"nvidia-smi -q -x refused: {exc}") from None
    if root.tag != "nvidia_smi_log":
        raise ParseError(f"nvidia-smi -q -x: unexpected root element {excerpt(root.tag)}")
    devices: dict[str, list[MigDevice]] = {}
    placement: dict[str, dict[int, tuple[int, int]]] = {}
    warnings: list[str] = []
    if dropped:
        warnings.append(f"MIG inventory: {dropped} malformed line(s) of nvidia-smi -q -x "
                        "ignored (a process name?)")
    for gpu in root.findall("gpu"):
        uuid_node = gpu.find("uuid")
        uuid = (uuid_node.text or "").strip() if uuid_node is not None else ""
        if not re.fullmatch(r"GPU-[0-9A-Za-z-]{1,64}", uuid):
            continue
        if uuid in devices:
            raise ParseError(f"nvidia-smi -q -x lists GPU {uuid} twice")
        devs = devices[uuid] = []
        for md in gpu.findall("mig_devices/mig_device"):
            fb = md.find("fb_memory_usage")
            devs.append(MigDevice(
                device_index=_int(md, "index"), gpu_instance_id=_int(md, "gpu_instance_id"),
                compute_instance_id=_int(md, "compute_instance_id"),
                memory_used_mib=_int(fb, "used"), memory_total_mib=_int(fb, "total")))
        seen: dict[int, tuple[int, int] | None] = {}
        for p in gpu.findall("processes/process_info"):
            pid, gi, ci = _int(p, "pid"), _int(p, "gpu_instance_id"), _int(p, "compute_instance_id")
            if pid is None:
                continue
            where = (gi, ci) if gi is not None and ci is not None else None
            if pid in seen and seen[pid] != where:
                warnings.append(f"MIG inventory: pid {pid} listed on two instances; "
                                "its instance is unknown")
                where = None
            seen[pid] = where
        placement[uuid] = {pid: w for pid, w in seen.items() if w is not None}
    return devices, placement, warnings


def build_inventory(list_text: str | None, xml_text: str | None) -> Inventory:
    """Join ``-L`` (profile, MIG uuid) and ``-q -x`` (ids, memory, placement) by GPU uuid
    and MIG device index. Either may be missing (None) or fail: what the other says stays."""
    warnings: list[str] = []
    listed = parse_list(list_text) if list_text is not None else {}
    xml_devs: dict[str, list[MigDevice]] = {}
    placement: dict[str, dict[int, tuple[int, int]]] = {}
    if xml_text is not None:
        try:
            xml_devs, placement, more = parse_xml(xml_text)
            warnings += more
        except ParseError as exc:
            warnings.append(f"MIG inventory: {exc}")
    devices: dict[str, tuple[MigDevice, ...]] = {}
    for gpu in list(listed) + [g for g in xml_devs if g not in listed]:
        by_index = {d.device_index: d for d in xml_devs.get(gpu, [])}
        merged: list[MigDevice] = []
        for d in listed.get(gpu, []) or xml_devs.get(gpu, []):
            x = by_index.pop(d.device_index, None) if gpu in listed else None
            if x is not None:
                d = replace(d, gpu_instance_id=x.gpu_instance_id,
                            compute_instance_id=x.compute_instance_id,
                            memory_used_mib=x.memory_used_mib,
                            memory_total_mib=x.memory_total_mib)
            merged.append(d)
        if merged:
            devices[gpu] = tuple(merged)
    return Inventory(devices, placement, tuple(warnings))


def unknown(gpus: Iterable[GpuInfo], inventory: Inventory | None,
            mig_uuids: Iterable[str] = ()) -> bool:
    """Whether this refresh shows MIG state the inventory does not know: a MIG-enabled GPU
    it has no devices for, a process on one it cannot place, or an unknown MIG uuid."""
    parents = inventory.parents if inventory else {}
    if any(u not in parents for u in mig_uuids):
        return True
    for g in gpus:
        if not is_mig(g) or g.uuid is None:
            continue
        if inventory is None or g.uuid not in inventory.devices:
            return True
        placed = inventory.placement.get(g.uuid, {})
        if any(p.pid not in placed and p.gpu_instance_id is None for p in g.processes):
            return True
    return False


def is_mig(g: GpuInfo) -> bool:
    return (g.mig_mode or "").lower() == "enabled"


def attach(gpus: Iterable[GpuInfo], inventory: Inventory,
           placed: Mapping[int, tuple[int, int]] | None = None) -> list[GpuInfo]:
    """Each MIG-enabled GPU with its instances as rows and its processes on them.

    ``placed`` (pid -> GI, CI) overrides the inventory where the refresh itself knew (a
    process reported under its MIG uuid). Utilisation stays None: NVML has none per MIG.
    """
    out: list[GpuInfo] = []
    for g in gpus:
        devs = inventory.devices.get(g.uuid or "") if is_mig(g) else None
        if not devs:
            out.append(g)
            continue
        where = dict(inventory.placement.get(g.uuid or "", {}))
        where.update(placed or {})
        procs = tuple(
            p if p.gpu_instance_id is not None or p.pid not in where
            else replace(p, gpu_instance_id=where[p.pid][0], compute_instance_id=where[p.pid][1])
            for p in g.processes)
        instances = tuple(
            MigInstance(
                gpu_instance_id=d.gpu_instance_id, compute_instance_id=d.compute_instance_id,
                device_index=d.device_index, uuid=d.uuid, profile=d.profile,
                memory_used_mib=d.memory_used_mib, memory_total_mib=d.memory_total_mib,
                processes=tuple(p for p in procs if d.gpu_instance_id is not None
                                and p.gpu_instance_id == d.gpu_instance_id
                                and p.compute_instance_id == d.compute_instance_id))
            for d in devs)
        out.append(replace(g, processes=procs, instances=instances))
    return out

