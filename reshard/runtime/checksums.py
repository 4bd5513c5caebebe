"""What a ``verify=True`` reshard compares: every received slice's checksum against the ones its
senders read (each device returns ``(tensor, step, "read" | "wrote", crc)``; the device side
computes them, ``reshard.runtime.device.batches``). Shared by the driver, which names the first
mismatch in its error, and by destinations, whose commit refuses one."""

from __future__ import annotations


def first_mismatch(checks_by_device: dict) -> tuple[int, int, int, int, set[int]] | None:
    """The first received slice whose checksum is not one its sender read, as ``(tensor, step,
    device, crc, crcs read)``, or None. ``checks_by_device[d]``: device ``d``'s ``checks``."""
    read: dict[tuple[int, int], set[int]] = {}
    wrote: list[tuple[int, int, int, int]] = []
    for d, checks in sorted(checks_by_device.items()):
        for tensor, step, kind, crc in checks or ():
            if kind == "read":
                read.setdefault((tensor, step), set()).add(crc)
            else:
                wrote.append((tensor, step, d, crc))
    for tensor, step, d, crc in wrote:
        if crc not in read.get((tensor, step), {crc}):
            return tensor, step, d, crc, read[(tensor, step)]
    return None
