"""``opforge new``: scaffold an operator package."""

from __future__ import annotations

import argparse

from opforge.cli.args import usage_error
from opforge.cli.render import out
from opforge.project import ProjectError, names_a_path, scaffold


def cmd_new(args: argparse.Namespace) -> int:
    try:
        if args.torch_min is not None and not args.stable_abi:
            usage_error("opforge new: --torch-min goes with --stable-abi")
        root = scaffold(
            args.name,
            args.dir,
            args.namespace,
            cuda=not args.no_cuda,
            backward=args.backward,
            stable_abi=args.stable_abi,
            torch_min=args.torch_min or "2.10",
        )
    except ProjectError as exc:
        # Writing the files failed (a full disk, a read-only folder): the error raised while
        # writing is its context. Anything else is what was asked for: a name, namespace,
        # version or folder the package cannot have, a usage error.
        if isinstance(exc.__context__, OSError):
            raise SystemExit(f"opforge new: {exc}") from None
        usage_error(f"opforge new: {exc}")
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    out.print(f"wrote {root}/: {', '.join(files)}", highlight=False)
    op = f"torch.ops.{args.namespace or args.name}.{args.name}"
    out.print(f"the operator: {op}, softsign for a start; {root}/README.md says how to make it yours", highlight=False)
    out.print("next:", highlight=False)
    # check and bench take a bare name for an operator's: the package is named as a path.
    where = str(root) if names_a_path(str(root)) else f"./{root}"
    for cmd in (f"opforge build {root}", f"opforge check {where}", f"opforge bench {where}", f"python -m pytest {root}/tests",
                f"pip install --no-build-isolation {root}"):  # fmt: skip
        out.print(f"  {cmd}", highlight=False)
    return 0
