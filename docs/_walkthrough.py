"""What every walk-through script shares: an --out-dir option, or a temporary directory."""

import argparse
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path


def run(main: Callable[[Path], None]) -> None:
    """Call ``main(out_dir)`` with --out-dir (created if needed) or a directory removed afterwards."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", type=Path, help="keep the files written here")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.out_dir:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        main(args.out_dir)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(Path(tmp))
