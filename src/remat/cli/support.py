"""What remat runs where: each model family under each parallel layout and precision, refused
where the code refuses it, otherwise where it is tested (CPU, gloo) or measured (GPU, NCCL).
"""

from __future__ import annotations

import argparse

from remat.bench import support
from remat.cli.common import out, show
from remat.cli.tables import support_table

HELP = "what runs where: model family x parallel layout x precision"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--markdown", action="store_true", help="print the table as the README holds it")
    p.add_argument("--reasons", action="store_true", help="say why each refused cell is refused")


def run(args: argparse.Namespace) -> int:
    cells = list(support.cells())
    if args.markdown:
        out.print(support.markdown(), markup=False)
    else:
        show(support_table(cells), keys=2)
    if args.reasons:
        for cell in cells:
            for problem in cell.refused:
                out.print(f"{cell.family}, {cell.precision}, {cell.layout}: {problem}", markup=False)
    return 0
