"""The `ome-publisher` command: argument parsing, printing and exit codes.

The only module that prints or exits. Each subcommand is one `_add_<name>(parser)` function
that declares its arguments and sets `run` to a function (args) -> exit code; `_SUBCOMMANDS`
lists them with their one-line help. The work itself lives in the stages (gate, verify, ...);
this module only shows it.

Only the chosen subcommand's arguments are declared, and the sidecar's machinery (the Kubernetes
client, gRPC, the loop) is imported only by the commands that use it: `--version`, `verify` on
files, `nginx-config` and `envoy-bootstrap` start in a fraction of a second.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable, Sequence

from publisher import __version__
from publisher.cli.command import EXIT_INPUT
from publisher.cli.demo_command import _add_demo
from publisher.cli.envoy_bootstrap_command import _add_envoy_bootstrap
from publisher.cli.nginx_config_command import _add_nginx_config
from publisher.cli.run_command import _add_run
from publisher.cli.status_command import _add_status
from publisher.cli.verify_command import _add_verify

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one subcommand and returns its exit code (the console script exits with it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, subparser = _parser(_command(argv))
    if subparser is not None:
        argv = _attach_dash_values(subparser, argv)
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            # The subcommand's own usage, and the flag that was probably meant.
            args.parser.error(_unrecognized(args.parser, unknown))
    except SystemExit as exc:  # argparse has printed the usage error (2) or the help (0)
        return exc.code if isinstance(exc.code, int) else EXIT_INPUT
    code: int = args.run(args)
    return code


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand argv names: the first word that is not an option (the top level's options,
    --help and --version, take no value)."""
    return next((word for word in argv if not word.startswith("-")), None)


def _parser(command: str | None) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser | None]:
    """The top-level parser and `command`'s, the only subcommand that declares its arguments."""
    parser = argparse.ArgumentParser(
        prog="ome-publisher",
        description="Publishes OME TrafficMap weights into a global gateway.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")
    chosen = None
    for name, (summary, add) in _SUBCOMMANDS.items():
        subparser = subparsers.add_parser(name, help=summary)
        if name == command:
            add(subparser)
            subparser.set_defaults(parser=subparser)
            chosen = subparser
    return parser, chosen


def _attach_dash_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """argv with `--opt -1s` written `--opt=-1s` where -1s is no option of `parser`: argparse
    takes any word starting with '-' for an option and answers "expected one argument", where
    the option's own check has a better word (a negative duration, a selector `-bad=x`)."""
    takes_value = {option for action in parser._actions if action.nargs is None for option in action.option_strings}
    options = [option for action in parser._actions for option in action.option_strings]

    def is_option(word: str) -> bool:
        head = word.split("=", 1)[0]
        if head.startswith("--"):
            return any(option.startswith(head) for option in options)  # argparse takes abbreviations
        return any(word.startswith(option) for option in options if not option.startswith("--"))

    attached: list[str] = []
    words = iter(argv)
    for word in words:
        following = next(words, None) if word in takes_value else None
        if following is None:
            attached.append(word)
        elif following.startswith("-") and following != "-" and not is_option(following):
            attached.append(f"{word}={following}")
        else:
            attached += [word, following]
    return attached


def _unrecognized(parser: argparse.ArgumentParser, unknown: Sequence[str]) -> str:
    message = f"unrecognized arguments: {' '.join(unknown)}"
    known = [option for action in parser._actions for option in action.option_strings]
    for word in unknown:
        if word.startswith("--"):
            close = difflib.get_close_matches(word.partition("=")[0], known, n=1)
            if close:
                return f"{message} (did you mean {close[0]}?)"
    return message


_SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "verify": ("check TrafficMaps in files, or on a cluster as the running sidecar does", _add_verify),
    "status": ("per map, OME's generation and each region's verdict, in either status mode", _add_status),
    "run": ("watch TrafficMaps and publish their weights into a gateway", _add_run),
    "envoy-bootstrap": ("print an Envoy bootstrap that serves what the envoy adapter publishes", _add_envoy_bootstrap),
    "nginx-config": ("print the NGINX http {} snippet that serves what the nginx adapter pushes in Lua mode", _add_nginx_config),
    "demo": ("see it work: local backends, a real Envoy, the publisher, and a measured split", _add_demo),
}
