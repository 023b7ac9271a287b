"""`python -m aserve`: see `aserve.server.cli`.

Run from the folder that holds a clone named `aserve`, Python imports that folder (no
`__init__.py`) as a namespace package before the installed one, and its `aserve` lacks the
package's attributes. This module is the installed package's own, so it puts that package in
place first."""

import importlib.util
import sys
from pathlib import Path

if getattr(sys.modules.get("aserve"), "__file__", None) is None:
    _here = Path(__file__).resolve().parent
    _spec = importlib.util.spec_from_file_location(
        "aserve", _here / "__init__.py", submodule_search_locations=[str(_here)])
    _package = importlib.util.module_from_spec(_spec)
    sys.modules["aserve"] = _package
    _spec.loader.exec_module(_package)

from aserve.server.cli import main  # noqa: E402 - after the package is in place

if __name__ == "__main__":
    raise SystemExit(main())
