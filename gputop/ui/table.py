"""A virtual table for the board: its cost follows the rows on screen, not the fleet.

Textual's DataTable keeps every cell of every row and throws away all its render caches on
any ``update_cell``, so at a few thousand GPUs the board spent its time building and storing
cells nobody could see. This table keeps only the ``Row`` objects (from the model) and their
order; cells are built for a row when it is on screen and its signature (see
``BoardModel.signature``) changed, and each on-screen row keeps one cached ``Strip``. A frame
where no visible row changed costs a few dict lookups.

It draws exactly like the DataTable it replaces: the same component classes
(``datatable--header``, ``datatable--cursor``...), CSS, padding and cell pipeline, cell for
cell; only without DataTable's per-cell meta (row and column) in the styles, which nothing
here reads (a click is placed by its line) and which made Rich's style caches miss.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from itertools import chain
from typing import ClassVar

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions
from rich.padding import Padding
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import events
from textual._segment_tools import line_crop
from textual.binding import Binding, BindingType
from textual.geometry import Region, Size, Spacing
from textual.message import Message
from textual.reactive import reactive
from textual.renderables.styled import Styled
from textual.scroll_view import ScrollView
from textual.strip import Strip
from textual.widgets import DataTable

from gputop.ui.board_rows import Row, host_of
from gputop.ui.cells import COLUMNS, Columns, Palette, columns_for, row_cells

Signature = Callable[[Row, datetime], tuple[object, ...]]
PAD = 1  # cell padding, each side (as DataTable's default)


def cell_segments(console: Console, options: ConsoleOptions, cell: Text, width: int,
                  pre: Style, post: Style) -> list[Segment]:
    """One cell, padded, as DataTable draws it: ``Styled(Padding(cell, (0, 1)), pre,
    post)`` rendered ``width`` wide on one line. A one-line cell that fits (nearly all of
    them) is put together directly, with the same segments and styles, at a fraction of
    the cost; anything else goes through Rich. A cell wider than its column is cut with
    an ellipsis (``…``), never silently."""
    inner = width - 2 * PAD
    plain = cell.plain
    n = cell_len(plain)
    if n > inner > 0 and "\n" not in plain:
        cell = cell.copy()
        cell.truncate(inner, overflow="ellipsis")
        plain = cell.plain
        n = cell_len(plain)
    if ("\n" in plain or "\t" in plain or cell.justify not in (None, "default", "left")
            or n > inner):
        rich_options = options.update_dimensions(width, 1).update(no_wrap=True)
        return console.render_lines(
            Styled(Padding(cell, (0, PAD)), pre_style=pre, post_style=post), rich_options)[0]
    if cell.spans:  # (``Text.render`` applies the Text's own style only with spans)
        text = [s for s in cell.render(console) if s.text]
    elif plain:
        text = [Segment(plain, console.get_style(cell.style) if cell.style else None)]
    else:
        text = []
    segments = [Segment(" " * PAD), *text, Segment(" " * (inner - n + PAD))]
    return list(Segment.apply_style(segments, pre, post))


class BoardTable(ScrollView, can_focus=True):
    """The GPU table. ``show_rows`` takes the full ordered row list (cheap: no cells) and
    refreshes the screen only when a row on it changed.

    The selection is a GPU, not a position: ``chosen`` is the key of the row the user moved
    to, and every redraw puts the cursor back on it. When it is gone (its host went down)
    the cursor goes to its host's row; with no such row the cursor is hidden and nothing is
    selected, so no key acts on a GPU the user did not choose."""

    ALLOW_SELECT = False
    DEFAULT_CSS = DataTable.DEFAULT_CSS.replace("DataTable", "BoardTable")
    COMPONENT_CLASSES = DataTable.COMPONENT_CLASSES
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "select_cursor", "Select", show=False),
        Binding("up,k", "cursor_up", "Up", show=False),
        Binding("down,j", "cursor_down", "Down", show=False),
        Binding("pageup", "page_up", "Page up", show=False),
        Binding("pagedown", "page_down", "Page down", show=False),
        Binding("home,ctrl+home", "scroll_top", "First row", show=False),
        Binding("end,ctrl+end", "scroll_bottom", "Last row", show=False),
    ]

    show_cursor: reactive[bool] = reactive(True)
    cursor_row: reactive[int] = reactive(0, always_update=False)

    class LayoutChanged(Message):
        """The table crossed the wide/narrow width: the board redraws every row."""

    class RowHighlighted(Message):
        """The cursor moved onto a row (by key or by a redraw)."""

    class RowSelected(Message):
        """Enter (or a second click) on the cursor's row."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._order: list[str] = []
        self._index: dict[str, int] = {}
        #: In the order of _order (a frame's rows: see FrameRows, whose hosts' rows are
        #: made when first looked at; the table looks at those on screen).
        self._rows: Sequence[Row] = []
        self._now: datetime | None = None
        self._signature: Signature | None = None
        self._palette: Palette | None = None
        #: key -> (signature, palette, narrow, cells): cells built for rows seen on screen.
        self._cells: dict[str, tuple[tuple[object, ...], Palette, bool, tuple[Text, ...]]] = {}
        #: key -> (what the strip depends on, strip).
        self._strips: dict[str, tuple[tuple[object, ...], Strip]] = {}
        self._header: tuple[tuple[object, ...], Strip] | None = None
        #: The hosts of the rows on screen and the cursor's (None: to be worked out).
        self._on_screen: frozenset[str] | None = None
        #: (style, cursor, position, width, content) -> the cell's segments.
        self._cell_strips: dict[tuple[object, ...], list[Segment]] = {}
        self._style_gen = 0
        #: ``rich_style``, the pseudo-class state and the columns' widths during a render
        #: pass (see render_lines).
        self._base: Style | None = None
        self._pseudo: object = None
        self._pass_widths: list[int] | None = None
        self._pass_width: int | None = None
        self.columns_shown: Columns = ()
        self.chosen: str | None = None
        self._restoring = False
        self.cell_updates = 0  # for tests: cells of on-screen rows whose content changed
        self.cells_built = 0  # for tests and the bench: rows whose cells were (re)built

    # -- the small API the app and the tests use -------------------------------------------

    @property
    def row_count(self) -> int:
        return len(self._order)

    @property
    def row_keys(self) -> list[str]:
        return list(self._order)

    @property
    def column_keys(self) -> list[str]:
        return [key for key, _, _ in self.columns_shown]

    @property
    def narrow(self) -> bool:
        return len(self.columns_shown) != len(COLUMNS)

    @property
    def rows_by_key(self) -> dict[str, Row]:
        return {r.key: r for r in self._rows}

    def row_of(self, key: str) -> Row | None:
        """The row as last drawn (the table keeps the list, not a dict made every frame)."""
        i = self._index.get(key)
        return None if i is None else self._rows[i]

    def get_row_index(self, key: str) -> int:
        return self._index[key]

    def get_cell(self, key: str, column: str) -> Text:
        """The cell as drawn (built now if the row was never on screen); a column a row's
        last cell spans (a host's) gives that cell."""
        cells = self._cells_of(key)
        return cells[min(self.column_keys.index(column), len(cells) - 1)]

    def selected_key(self) -> str | None:
        """The row the user chose and the cursor is on; None when nothing is selected."""
        if not self.show_cursor or not 0 <= self.cursor_row < len(self._order):
            return None
        return self._order[self.cursor_row]

    # -- feeding ------------------------------------------------------------------------

    def on_mount(self) -> None:
        self._set_columns(columns_for(self.app.size.width))

    def _set_columns(self, columns: Columns) -> None:
        self.columns_shown = columns
        self._cells, self._strips, self._header = {}, {}, None
        self.refresh()

    def on_resize(self, event: events.Resize) -> None:
        self._on_screen = None
        self._strips, self._header = {}, None
        self._update_virtual_size()
        if columns_for(event.size.width) != self.columns_shown:
            self.post_message(self.LayoutChanged())

    def show_rows(self, rows: Sequence[Row], now: datetime, palette: Palette,
                  signature: Signature, keys: list[str] | None = None) -> None:
        """``keys``: the rows' keys, where the caller has them (the board's model makes
        them with each host's rows: a frame then need not look at every row)."""
        self._restoring = True  # rows come and go under the cursor: not the user's choice
        try:
            self._show_rows(rows, now, palette, signature,
                            [r.key for r in rows] if keys is None else keys)
        finally:
            self._restoring = False

    def _show_rows(self, rows: Sequence[Row], now: datetime, palette: Palette,
                   signature: Signature, keys: list[str]) -> None:
        wanted_columns = columns_for(self.size.width or self.app.size.width)
        if wanted_columns != self.columns_shown:
            self._set_columns(wanted_columns)
        if palette != self._palette:  # a new theme: every cell's colours change
            self._palette, self._cells, self._strips = palette, {}, {}
            self.refresh()
        if self.chosen is None and self._order:
            self.chosen = self.selected_key()
        self._now, self._signature = now, signature
        self._rows = rows
        if keys != self._order:
            self._order = keys
            self._on_screen = None
            self._index = {k: i for i, k in enumerate(keys)}
            gone = [k for k in self._cells if k not in self._index]
            for k in gone:
                del self._cells[k]
                self._strips.pop(k, None)
            self._update_virtual_size()
            self.refresh()
        self._restore()
        self._refresh_visible()

    def _update_virtual_size(self) -> None:
        self.virtual_size = Size(self._table_width(), len(self._order) + 1)

    def _visible(self) -> range:
        top = self.scroll_offset.y
        height = max(0, self.scrollable_content_region.height - 1)  # less the header
        return range(top, min(len(self._order), top + height))

    def hosts_on_screen(self) -> frozenset[str]:
        """The hosts whose rows are on screen, and the cursor's: the board draws answers
        from other hosts less often (see ``BoardIntake._frame_due``, gputop.ui.intake).
        Asked for each answer: kept until the rows, the scroll position, the size or the
        cursor change."""
        hosts = self._on_screen
        if hosts is None:
            rows = self._rows
            found = {rows[i].host for i in self._visible()}
            if 0 <= self.cursor_row < len(rows):
                found.add(rows[self.cursor_row].host)
            hosts = self._on_screen = frozenset(found)
        return hosts

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        self._on_screen = None
        super().watch_scroll_y(old_value, new_value)

    def _refresh_visible(self) -> None:
        """Rebuild the cells of on-screen rows whose signature changed and redraw the
        lines of those whose content did (only those: the compositor then renders a few
        lines, not the table), all in one call. Rows off screen are not looked at."""
        changed = []
        for i in self._visible():
            key = self._order[i]
            had = self._cells.get(key)
            cells = self._cells_of(key)
            if had is not None and had[3] is not cells:
                diff = sum(1 for new, was in zip(cells, had[3]) if new != was)
                if diff:
                    self.cell_updates += diff
                    self._strips.pop(key, None)
                    changed.append(i)
            elif had is None:
                changed.append(i)
        if changed:
            self._refresh_rows(changed)

    def _cells_of(self, key: str) -> tuple[Text, ...]:
        row, now, signature = self._rows[self._index[key]], self._now, self._signature
        palette = self._palette
        assert now is not None and signature is not None and palette is not None
        sig = signature(row, now)
        narrow = self.narrow
        had = self._cells.get(key)
        if had is not None and had[0] == sig and had[1] == palette and had[2] == narrow:
            return had[3]
        cells = row_cells(row, now, palette, narrow)
        self.cells_built += 1
        if had is not None and had[3] == cells and had[1] == palette and had[2] == narrow:
            cells = had[3]  # the same content: keep the object (and its strip)
        self._cells[key] = (sig, palette, narrow, cells)
        return cells

    # -- the cursor ---------------------------------------------------------------------

    def validate_cursor_row(self, row: int) -> int:
        return max(0, min(row, len(self._order) - 1))

    def watch_cursor_row(self, old: int, new: int) -> None:
        self._on_screen = None
        self._refresh_row(old)
        self._refresh_row(new)
        if not self._restoring and 0 <= new < len(self._order):
            self.chosen = self._order[new]  # the user moved: this is the choice now
            self.show_cursor = True
        self._scroll_cursor_into_view()
        self.post_message(self.RowHighlighted())

    def watch_show_cursor(self, show: bool) -> None:
        self._refresh_row(self.cursor_row)
        if show:
            self._scroll_cursor_into_view()
            self.post_message(self.RowHighlighted())

    def move_cursor(self, *, row: int, animate: bool = False) -> None:
        self.cursor_row = row
        self._scroll_cursor_into_view(animate=animate)

    def _scroll_cursor_into_view(self, animate: bool = False) -> None:
        if not self._order:
            return
        region = Region(self.scroll_offset.x, self.cursor_row + 1, self.size.width, 1)
        self.scroll_to_region(region, animate=animate, spacing=Spacing(1, 0, 0, 0),
                              force=True)

    def _refresh_row(self, row: int) -> None:
        self._refresh_rows((row,))

    def _refresh_rows(self, rows: Iterable[int]) -> None:
        top, height = self.scroll_offset.y, self.size.height
        width = self.scrollable_content_region.width
        regions = [Region(0, y, width, 1) for y in (row + 1 - top for row in rows)
                   if 0 < y < height]
        if regions:
            self.refresh(*regions)

    def _wake(self) -> None:
        """A key pressed while nothing was selected: select the row under the cursor."""
        if not self.show_cursor and self._order:
            self.show_cursor = True
            self.chosen = self._order[min(self.cursor_row, len(self._order) - 1)]

    def _restore(self) -> None:
        """Put the cursor back on the chosen GPU, else on its host, else select nothing."""
        if self.chosen is None:
            if self._order:
                self.chosen = self._order[min(max(self.cursor_row, 0), len(self._order) - 1)]
            return
        for key in (self.chosen, host_of(self.chosen)):
            row = self._index.get(key)
            if row is not None:
                self.show_cursor = True
                if row != self.cursor_row:  # (moving scrolls: leave a mouse scroll alone)
                    self.move_cursor(row=row)
                return
        self.show_cursor = False  # the choice is gone and so is its host: nothing selected

    async def _on_key(self, event: events.Key) -> None:
        """A key that was on its way here when an earlier key moved the focus away (a
        dialog opened: the keys typed right after were already queued for the table) was
        typed before what has the focus now was shown: it is dropped, never acts on the
        board or in the dialog."""
        focused = self.app.focused
        if focused is not self and (focused is not None or self.app.screen is not self.screen):
            event.stop()
            event.prevent_default()
            return
        await super()._on_key(event)

    async def _on_click(self, event: events.Click) -> None:
        self._wake()
        row = event.y - 1 + self.scroll_offset.y
        if event.y < 1 or not 0 <= row < len(self._order):
            return
        again = row == self.cursor_row and self.show_cursor
        self.cursor_row = row
        self.show_cursor = True
        if again:
            self.post_message(self.RowSelected())
        event.stop()

    def action_select_cursor(self) -> None:
        if self.show_cursor and self._order:
            self.post_message(self.RowSelected())

    def action_cursor_up(self) -> None:
        self._wake()
        self.cursor_row -= 1

    def action_cursor_down(self) -> None:
        self._wake()
        self.cursor_row += 1

    def _page(self) -> int:
        """Rows a page moves: those on screen (less the header) less one, so the last row
        of a page is the first of the next and nothing passes unseen."""
        return max(1, self.scrollable_content_region.height - 2)

    def action_page_up(self) -> None:
        self._wake()
        self.scroll_relative(y=-self._page(), animate=False)
        self.cursor_row -= self._page()

    def action_page_down(self) -> None:
        self._wake()
        self.scroll_relative(y=self._page(), animate=False, force=True)
        self.cursor_row += self._page()

    def action_scroll_top(self) -> None:
        self._wake()
        self.cursor_row = 0

    def action_scroll_bottom(self) -> None:
        self._wake()
        self.cursor_row = len(self._order) - 1

    # -- drawing (DataTable's pipeline, for the same look) --------------------------------

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._style_gen += 1
        self._strips, self._header, self._cell_strips = {}, None, {}
        self.refresh()

    def _widths(self) -> list[int]:
        """Render widths with padding; the flags column takes what is left (its whole
        text is in the detail pane), so nothing scrolls sideways."""
        fixed = [w + 2 * PAD for _, _, w in self.columns_shown if w is not None]
        rest = self.scrollable_content_region.width - sum(fixed)
        return [w + 2 * PAD if w is not None else max(8 + 2 * PAD, rest)
                for _, _, w in self.columns_shown]

    def _table_width(self) -> int:
        return sum(self._widths())

    def render_lines(self, crop: Region) -> list[Strip]:
        """The widget's style, its pseudo-class state and the columns' widths are worked
        out once per pass (Textual walks every ancestor's styles for the first: twice per
        line was a fifth of drawing a frame), not kept between passes: a theme, focus or
        size change is seen by the next."""
        self._base = self.rich_style
        self._pseudo = self.get_pseudo_class_state()
        self._pass_widths = self._widths()
        self._pass_width = self.size.width  # (it finds the widget on its screen: once per
        # line it was a fifth of drawing the table's lines)
        try:
            return super().render_lines(crop)
        finally:
            self._base = self._pseudo = self._pass_widths = self._pass_width = None

    def _pseudo_state(self) -> object:
        return self._pseudo if self._pseudo is not None else self.get_pseudo_class_state()

    def render_line(self, y: int) -> Strip:
        width = self._pass_width if self._pass_width is not None else self.size.width
        base = self._base if self._base is not None else self.rich_style
        if y == 0:
            return self._header_strip(base, width)
        row = y - 1 + self.scroll_offset.y
        if not 0 <= row < len(self._order):
            return Strip.blank(width, base)
        key = self._order[row]
        cells = self._cells_of(key)
        cursor = self.show_cursor and row == self.cursor_row
        state = (id(cells), cursor, width, base, self._style_gen, self._pseudo_state())
        had = self._strips.get(key)
        if had is not None and had[0] == state:
            return had[1]
        strip = self._render_row(cells, base, width, cursor)
        self._strips[key] = (state, strip)
        return strip

    def _header_strip(self, base: Style, width: int) -> Strip:
        state = (width, base, self._style_gen, self._pseudo_state(), self.columns_shown)
        if self._header is not None and self._header[0] == state:
            return self._header[1]
        header = self.get_component_styles("datatable--header").rich_style
        labels = tuple(Text(label) for _, label, _ in self.columns_shown)
        strip = self._render_row(labels, header, width, False)
        self._header = (state, strip)
        return strip

    def _render_row(self, cells: tuple[Text, ...], row_style: Style, width: int,
                    cursor: bool) -> Strip:
        console = self.app.console
        component = Style()
        post = Style()
        if cursor:
            component = self.get_component_rich_style("datatable--cursor")
            post = Style.from_color(color=component.color)  # the CSS's foreground wins
        parts: list[list[Segment]] = []
        widths = self._pass_widths if self._pass_widths is not None else self._widths()
        if len(cells) < len(widths):  # a host's row: its last cell spans the rest
            widths = [*widths[:len(cells) - 1], sum(widths[len(cells) - 1:])]
        cache = self._cell_strips
        if len(cache) > 20_000:  # a bound; what is on screen comes back in one frame
            cache.clear()
        # (No meta with the row and column in each cell's style, as DataTable has: clicks
        # are placed by their line (_on_click). With it, every cell's style was its own,
        # and Rich's cache of added styles missed for most of them.)
        pre = row_style + component
        options = None
        for cell, cell_width in zip(cells, widths):
            key = (pre, post, cell_width, cell.plain, cell.style, tuple(cell.spans))
            segments = cache.get(key)
            if segments is None:  # a cell that changed (most of a changed row did not)
                if options is None:
                    options = self.app.console_options
                segments = cache[key] = cell_segments(console, options, cell, cell_width,
                                                      pre, post)
            parts.append(segments)
        used = sum(widths)
        if used <= width:  # (nearly always: the cells, then the rest of the line, padded)
            parts.append([Segment(" " * (width - used), pre)])
            return Strip(Segment.simplify(chain.from_iterable(parts)), width)
        segments = line_crop(list(chain.from_iterable(parts)), 0, width, width)
        return Strip(segments).adjust_cell_length(
            width, self._base if self._base is not None else self.rich_style).simplify()
