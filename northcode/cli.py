"""The `northcode` command: dispatches to one module per subcommand in northcode/commands/.

Each command module defines `HELP` (one line), `add_arguments(parser)` and `run(args) -> int`,
and imports its heavy dependencies (torch, textual, uvicorn) inside `run`, so that
`northcode --help` and every other command start fast. With no subcommand, `northcode`
opens the terminal app (`northcode tui`).
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {  # name -> (module, one-line help shown by `northcode --help`)
    "tui": ("northcode.commands.tui", "the terminal app for chat and agent sessions (the default)"),
    "serve": ("northcode.commands.serve", "serve the model on a local OpenAI-compatible endpoint"),
    "run": ("northcode.commands.run", "run the agent headless on a task: northcode run -p 'task'"),
    "generate": ("northcode.commands.generate", "raw completion of a prompt, streamed to stdout"),
    "checkpoint": ("northcode.commands.checkpoint", "create synthetic checkpoints (random weights)"),
    "bench": ("northcode.commands.bench", "benchmarks: bench engine | bench decode"),
    "doctor": ("northcode.commands.doctor", "report Python, torch, CUDA, nvcc and the model northcode would load"),
}


def _top_level_help() -> str:
    lines = ["usage: northcode [COMMAND] [options]", "", "With no command, opens the terminal app.", "", "commands:"]
    lines += [f"  {name:<11} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `northcode COMMAND --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help", "help"):
        print(_top_level_help())
        return 0
    if argv and argv[0] == "--version":
        from importlib.metadata import version

        print(f"northcode {version('northcode')}")
        return 0
    name = argv.pop(0) if argv and argv[0] in COMMANDS else "tui"
    module_name, help_ = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"northcode {name}" if name != "tui" else "northcode", description=help_)
    module.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except ValueError as err:  # bad user input: a message, not a traceback
        print(f"northcode {name}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
