"""Shares on the board (Textual pilot, the fixed fleet of board_data): a shared GPU's rows,
`r` offering a share, `u` releasing yours."""

from __future__ import annotations

from pathlib import Path

from gputop.model import utcnow
from gputop.reservations.ops import Target
from gputop.reservations.shares import reserve_share
from gputop.reservations.store import Store
from gputop.reservations.terms import Terms
from gputop.ui.board_rows import SHARE_SEP
from tests.test_board import cell, gk, goto, load, make_app

TOTAL = 81559
G = 1024


def _shares(tmp_path: Path) -> list[tuple[int, str, int | None]]:
    return [(r.gpu, r.user, r.share_mib)
            for r in Store(tmp_path / "reservations.json").read().reservations]


async def test_a_shared_gpu_shows_its_shares_and_r_takes_one(tmp_path: Path) -> None:
    store = Store(tmp_path / "reservations.json")
    # gpu-h100:0 runs alice's job (19000 MiB); she and bob share it
    for user, gib in (("alice", 30), ("bob", 16)):
        reserve_share(
            store, Target("gpu-h100", 0, "GPU-00000000-test"), TOTAL,
            Terms(3600, max_seconds=86400, user=user, machine="m", share_mib=gib * G))
    app = make_app(tmp_path, clock=utcnow)
    async with app.run_test(size=(120, 40)) as pilot:
        table = await load(app, pilot)
        key = gk("gpu-h100", 0)
        rows = table.row_keys
        at = rows.index(key)
        assert rows[at + 1:at + 3] == [f"{key}{SHARE_SEP}alice", f"{key}{SHARE_SEP}bob"]
        assert cell(table, key, "resv") == "33.6G left"
        assert "share 30G" in cell(table, f"{key}{SHARE_SEP}alice", "gpu")
        assert cell(table, f"{key}{SHARE_SEP}alice", "mem").strip().endswith("19/30G")
        assert cell(table, f"{key}{SHARE_SEP}bob", "resv").startswith("bob ")
        # the summary counts the GPU once, as shared (the document's summary's class)
        assert app.model.summary().shared == 1
        # and its host's header counts GPUs, not the share rows under one
        head = next(r for r in app.model.rows() if getattr(r, "host", None) == "gpu-h100"
                    and type(r).__name__ == "HostRow")
        assert head.gpu_count == 4, head  # (4 GPUs; 2 share rows under one)
        # r on a share row: a share of its GPU (ann's), sized in the dialog
        goto(app, table, f"{key}{SHARE_SEP}bob")
        await pilot.press("r")
        await pilot.pause()
        labels = [str(w.render()) for w in app.screen.query("Label")]
        assert any("33.6G left unshared" in t for t in labels), labels
        app.screen.query_one("#reserve-share").value = "40G"  # type: ignore[attr-defined]
        await pilot.click("#reserve-ok")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert (0, "ann", 40 * G) not in _shares(tmp_path)  # refused: 33.6G left
        goto(app, table, key)
        await pilot.press("r")
        await pilot.pause()
        app.screen.query_one("#reserve-share").value = "8G"  # type: ignore[attr-defined]
        await pilot.click("#reserve-ok")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert (0, "ann", 8 * G) in _shares(tmp_path)
        assert f"{key}{SHARE_SEP}ann" in table.row_keys
        # u releases ann's share, nobody else's
        goto(app, table, key)
        await pilot.press("u")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert sorted(u for _, u, _ in _shares(tmp_path)) == ["alice", "bob"]


async def test_r_on_an_untouched_gpu_offers_a_share(tmp_path: Path) -> None:
    app = make_app(tmp_path, clock=utcnow)
    async with app.run_test(size=(120, 40)) as pilot:
        table = await load(app, pilot)
        goto(app, table, gk("gpu-h100", 2))
        await pilot.press("r")
        await pilot.pause()
        app.screen.query_one("#reserve-share").value = "16"  # type: ignore[attr-defined]
        await pilot.click("#reserve-ok")
        await pilot.pause()
        err = app.screen.query_one("#reserve-error").render()
        assert "needs a unit" in str(err)
        field = app.screen.query_one("#reserve-share")
        field.value = "16G"  # type: ignore[attr-defined]
        field.focus()  # (a second click on the button at once would be a double click)
        await pilot.press("enter")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert _shares(tmp_path) == [(2, "ann", 16 * G)]
        assert cell(table, gk("gpu-h100", 2), "resv") == "63.6G left"
        # empty: the whole GPU, as before
        goto(app, table, gk("gpu-mixed", 0))
        await pilot.press("r")
        await pilot.pause()
        await pilot.click("#reserve-ok")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert (0, "ann", None) in _shares(tmp_path)
