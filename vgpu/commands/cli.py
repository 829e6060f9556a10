"""The `vgpu` command: one entry point, a subcommand per part.

Each subcommand lives in its own module, which exposes ``register(parser)`` to
declare its arguments and ``run(args) -> int`` to carry it out. Modules are
imported only when their subcommand runs, so ``vgpu status`` never pays for
grpc and ``vgpu device-plugin`` never pays for Flask.

Other distributions add subcommands through the ``vgpu.commands`` entry-point
group (name = module). The developer's sandbox (``sandbox/`` in the repository,
never in the wheel or the images) registers ``vgpu sandbox`` that way, so
nothing in ``vgpu`` imports it.

A command that fails says so in one line on stderr (what went wrong, what to do) and exits
non-zero; an error no command expected is caught here too, as one line, unless ``VGPU_DEBUG`` is
set (then the traceback shows where it came from). A command whose output's reader went away
(``vgpu sandbox status | head -3``) ends quietly with 141, as Unix tools do
(:mod:`vgpu.core.output`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points

from vgpu.core.errors import VgpuError
from vgpu.core.output import run_command

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "extender": ("vgpu.extender.cli", "the kube-scheduler extender and admission webhook"),
    "device-plugin": ("vgpu.commands.device_plugin", "the kubelet device plugin for one node"),
    "dra-plugin": ("vgpu.dra.cli", "the DRA driver's node plugin: ResourceSlices, claims through CDI"),
    "monitor": ("vgpu.monitor.cli", "the node monitor: /metrics from the hook's regions"),
    "status": ("vgpu.commands.status", "which container got which vGPU, per node and card"),
    "limits": ("vgpu.commands.limits", "change a running container's limits through its region"),
}
PLUGIN_GROUP = "vgpu.commands"


def commands() -> dict[str, tuple[str, str]]:
    """The built-in subcommands, then those other installed distributions declare."""
    found = dict(COMMANDS)
    for ep in entry_points(group=PLUGIN_GROUP):
        if ep.name not in found:
            summary = ep.dist.metadata["Summary"] if ep.dist is not None else None
            found[ep.name] = (ep.value, summary or f"from the {ep.value} plugin")
    return found


def _load(module: str) -> object | None:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is not None and module.startswith(err.name):
            return None  # that part is not installed in this build
        raise


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vgpu", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in commands().items():
        if only is not None and name != only:
            sub.add_parser(name, help=help_text, add_help=False)
            continue
        mod = _load(module)
        if mod is None:
            continue
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod.register(p)  # type: ignore[attr-defined]
        p.set_defaults(_module=mod)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    first = next((a for a in args_list if not a.startswith("-")), None)
    parser = build_parser(only=first if first in commands() else None)
    args = parser.parse_args(args_list)
    mod = getattr(args, "_module", None)
    if mod is None:
        parser.print_help()
        return 2
    try:
        return run_command(lambda: int(mod.run(args) or 0))
    except KeyboardInterrupt:
        print(f"vgpu {args.command}: interrupted", file=sys.stderr)
        return 130
    except VgpuError as err:  # each command catches its own; this is the net under them
        print(f"vgpu {args.command}: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    except Exception as err:
        if os.environ.get("VGPU_DEBUG"):
            raise
        print(
            f"vgpu {args.command}: unexpected {type(err).__name__}: {' '.join(str(err).split())[:300]} "
            "(a bug: please report it with the output of the same command run with VGPU_DEBUG=1)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
