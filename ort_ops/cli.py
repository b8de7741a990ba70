# SPDX-License-Identifier: MIT
"""The ``ort-ops`` command line: info, rewrite, verify, bench.

Errors in the input (files, models, arguments) print one line (``ort-ops: <message>``) and exit
2; a rewritten model is written to a temporary file and renamed into place, so a failed command
leaves no partial output.
"""

from __future__ import annotations

import argparse
import json
import sys


def _cmd_info(args: argparse.Namespace) -> int:
    import os

    import ort_ops

    info: dict = {"ort_ops_version": ort_ops.__version__}
    try:
        import onnxruntime as ort

        info["onnxruntime_version"] = ort.__version__
        info["onnxruntime_providers"] = ort.get_available_providers()
    except ImportError as e:
        info["onnxruntime_version"] = f"not importable ({e})"
    info["library_path"] = ort_ops.get_library_path()
    build = ort_ops.build_info()
    info["library"] = build
    info["cpu_isa_in_use"] = ort_ops._lib.selected_cpu_isa()
    info["cpu_isa_cap"] = os.environ.get("ORT_OPS_CPU_ISA") or None
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"ort-ops {info['ort_ops_version']}")
    print(f"  library          {info['library_path']}")
    print(f"  library version  {build['version']} (asks for ORT C API {build['ort_api_version']}, "
          f"ORT >= {build['min_ort_version']}; headers API {build['headers_ort_api_version']})")
    print(f"  onnxruntime      {info['onnxruntime_version']}")
    isa = build["cpu_isa"]
    print("  CPU features     " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in isa.items()))
    cap = f" (capped by ORT_OPS_CPU_ISA={info['cpu_isa_cap']})" if info["cpu_isa_cap"] else ""
    print(f"  CPU kernels      {info['cpu_isa_in_use']}{cap}")
    cuda = f"built for {build['cuda_archs']} ({build.get('cuda_runtime', '')})" if build["cuda"] else "not built"
    print(f"  CUDA             {cuda}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ort-ops",
        description="INT8 KV cache, INT8 paged attention and INT8 MoE for ONNX Runtime.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    info = sub.add_parser("info", help="package, library, ORT version, CPU features, CUDA build status")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(func=_cmd_info)
    from ort_ops._commands import register  # rewrite, verify, bench (imports numpy, onnx-ir)

    register(sub)
    return p


def _is_user_error(e: Exception) -> bool:
    """Errors that describe the input (a file, a model, an argument, the machine) rather than a bug
    of ort-ops: ours are ValueError/FileNotFoundError/OSError/RuntimeError; onnxruntime's own
    (InvalidArgument, Fail, NoSuchFile, ...) derive from Exception in its pybind module."""
    return isinstance(e, (ValueError, OSError, RuntimeError)) or type(e).__module__.startswith("onnxruntime")


def _one_line(e: Exception) -> str:
    """The error message on one line (onnxruntime's and protobuf's may span several)."""
    return " ".join(str(e).split()) or type(e).__name__


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except Exception as e:  # noqa: BLE001 - mapped to exit 2 below, or re-raised
        if not _is_user_error(e):
            raise
        print(f"ort-ops: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ort-ops: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
