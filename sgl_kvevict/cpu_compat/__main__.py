"""`python -m sgl_kvevict.cpu_compat install|uninstall|status`: manage the `.pth` that loads the stand-in."""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

from sgl_kvevict.cpu_compat import real_sgl_kernel_present

PTH = Path(sysconfig.get_paths()["purelib"]) / "sgl_kvevict_cpu_compat.pth"
LINE = "import sgl_kvevict.cpu_compat as _c; _c.install_finder()\n"


def main(argv: list[str]) -> int:
    cmd = argv[0] if argv else "status"
    if cmd == "install":
        if real_sgl_kernel_present():
            print("[cpu_compat] a real sgl_kernel is installed: no stand-in needed")
            PTH.unlink(missing_ok=True)
            return 0
        if not PTH.exists() or PTH.read_text() != LINE:
            PTH.write_text(LINE)
            print(f"[cpu_compat] installed the sgl_kernel CPU stand-in hook: {PTH}")
        return 0
    if cmd == "uninstall":
        PTH.unlink(missing_ok=True)
        return 0
    print(f"pth={PTH} exists={PTH.exists()} real_sgl_kernel={real_sgl_kernel_present()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
