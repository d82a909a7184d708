"""The `ome-publisher` command: argument parsing, printing and exit codes.

The only package that prints or exits. `main` and the parser's assembly live here; each subcommand
is one module (`verify_command`, `status_command`, `run_command`, `envoy_bootstrap_command`,
`nginx_config_command`, `demo_command`) whose `add_arguments(parser)` declares its arguments and
sets `run` to a function (args) -> exit code; `_SUBCOMMANDS` lists them with their one-line help,
and `command` holds what they share (exit codes, output formats, printing a document). Beside them:
`config` (the run configuration from flags, environment and file), `app` (the sidecar assembled
from a configuration) and `demo`. The work itself lives in the stages (gate, verify, ...); this
package only shows it.

Owns no state of the sidecar's: the configuration it reads is handed to `app`. May import every
other part of publisher/ and adapters/ (it is the top layer of import-linter's "pipeline-layers"
contract); inside it the subcommands sit above app and demo, above config ("cli-layers").

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
from publisher.cli import (
    demo_command,
    envoy_bootstrap_command,
    nginx_config_command,
    run_command,
    status_command,
    verify_command,
)
from publisher.cli.command import EXIT_INPUT

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one subcommand and returns its exit code (the console script exits with it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, subparser = build_parser(_command(argv))
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


def build_parser(command: str | None) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser | None]:
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
    "verify": ("check TrafficMaps in files, or on a cluster as the running sidecar does", verify_command.add_arguments),
    "status": ("per map, OME's generation and each region's verdict, in either status mode", status_command.add_arguments),
    "run": ("watch TrafficMaps and publish their weights into a gateway", run_command.add_arguments),
    "envoy-bootstrap": ("print an Envoy bootstrap that serves what the envoy adapter publishes", envoy_bootstrap_command.add_arguments),
    "nginx-config": ("print the NGINX http {} snippet that serves what the nginx adapter pushes in Lua mode", nginx_config_command.add_arguments),
    "demo": ("see it work: local backends, a real Envoy, the publisher, and a measured split", demo_command.add_arguments),
}
