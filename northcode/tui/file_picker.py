"""The @ file picker: while an @path is typed in the prompt, the workspace's files that match it, best first.

The prompt keeps the focus and the keys: it passes Up/Down/Tab/Enter/Esc on as PromptInput.PickerKey
while the picker shows (picker_open). Matching is Textual's fuzzy matcher, after a cheap in-order check;
the file list (agent/file_search.workspace_files: git's, .gitignore respected) is read in a thread,
afresh each time the picker opens.
"""

from __future__ import annotations

import re

from textual import work
from textual.fuzzy import Matcher
from textual.widgets import OptionList
from textual.widgets.option_list import Option

from northcode.agent.file_search import workspace_files
from northcode.agent.sandbox import Workspace
from northcode.tui.widgets import PromptInput


class FilePicker(OptionList):
    """The @ picker for `prompt` over `workspace`'s files."""

    MAX_SHOWN = 8
    MAX_SCORED = 2000  # candidates scored per key press, after a cheap in-order check

    def __init__(self, workspace: Workspace, **kwargs) -> None:
        super().__init__(**kwargs)
        self.workspace = workspace
        self.files: list[str] = []
        self.closed = False  # Esc closed it: it stays closed until the @ being typed ends

    def on_mount(self) -> None:
        self.display, self.can_focus = False, False

    @property
    def prompt(self) -> PromptInput:
        return self.screen.query_one(PromptInput)  # its own screen's, whatever screen is on top

    def follow(self) -> None:
        """Show the files that match the @ being typed at the prompt's cursor, or hide."""
        query = self.prompt.mention_query()
        if query is None or self.closed:
            self.closed = self.closed and query is not None
            self.display = self.prompt.picker_open = False
            return
        if not self.prompt.picker_open:
            self.load_files()
        self.show_matches(query, self.files)
        self.prompt.picker_open = self.display

    @work(thread=True, exclusive=True, group="files", exit_on_error=False)
    def load_files(self) -> None:
        files = workspace_files(self.workspace)
        self.app.call_from_thread(self._files_loaded, files)

    def _files_loaded(self, files: list[str]) -> None:
        self.files = files
        if self.prompt.mention_query() is not None:
            self.follow()

    def press(self, key: str) -> None:
        """A key the prompt passed on: up, down, escape, or tab/enter (take the highlighted file)."""
        if key == "up":
            self.action_cursor_up()
        elif key == "down":
            self.action_cursor_down()
        elif key == "escape":
            self.closed = True
            self.display = self.prompt.picker_open = False
        elif self.chosen is not None:
            self.prompt.complete_mention(self.chosen)

    def show_matches(self, query: str, files: list[str]) -> None:
        """Fill the list for `query`; hidden when nothing matches."""
        in_order = re.compile(".*?".join(map(re.escape, query)), re.I)
        candidates = [f for f in files if in_order.search(f)][: self.MAX_SCORED]
        if query:
            matcher = Matcher(query)
            scored = sorted(((matcher.match(f), f) for f in candidates), key=lambda pair: (-pair[0], len(pair[1])))
            options = [Option(matcher.highlight(f), id=f) for score, f in scored[: self.MAX_SHOWN] if score > 0]
        else:
            options = [Option(f, id=f) for f in candidates[: self.MAX_SHOWN]]
        self.clear_options()
        self.add_options(options)
        self.display = bool(options)
        if options:
            self.highlighted = 0

    @property
    def chosen(self) -> str | None:
        """The highlighted file."""
        return self.get_option_at_index(self.highlighted).id if self.highlighted is not None else None
