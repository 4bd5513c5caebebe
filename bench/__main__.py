"""Benchmarks, one suite per subcommand (``SUITES``, what ``python -m bench --help`` prints first)."""

from __future__ import annotations

import sys

SUITES = """suites (each has its own --help):
  python -m bench [options]              local microbenchmarks: our reshard beside its peers (below)
  python -m bench weights [options]      whole-model weight sync: state dicts in one call, beside the peers
  python -m bench framework [options]    a weight sync out of a framework's own tensors, beside the library's
  python -m bench train-sync [options]   Ray Train + FSDP2 + Hugging Face into inference actors, beside a naive refit
  python -m bench --simulate [options]   paper-scale simulation of the planners
  python -m bench pipeline [options]     pipeline schedules, real and simulated
  python -m bench multihost [options]    Ray nodes on emulated hosts with shaped NICs (root)
  python -m bench multihost --weights    a whole model's sync across emulated hosts (root)
  python -m bench emulate ...            bring emulated hosts up and down by hand (root)
  python -m bench path                   the files one reshard runs through, driver to bytes
  python -m bench gpu [options]          the GPU data plane on this machine's GPUs (one is enough)
  python -m bench gpu-predict [options]  weight syncs between GPUs, predicted from one GPU's figures
"""


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(SUITES)
    if argv[:1] == ["pipeline"]:
        from bench.pipeline import main as run

        return run(argv[1:])
    if argv[:1] == ["multihost"] and "--weights" in argv:
        from bench.multihost_weights import main as run

        return run([a for a in argv[1:] if a != "--weights"])
    if argv[:1] == ["multihost"]:
        from bench.multihost import main as run

        return run(argv[1:])
    if argv[:1] == ["weights"]:
        from bench.weights import main as run

        return run(argv[1:])
    if argv[:1] == ["framework"]:
        from bench.framework import main as run

        return run(argv[1:])
    if argv[:1] == ["train-sync"]:
        from bench.train_sync import main as run

        return run(argv[1:])
    if argv[:1] == ["gpu"]:
        from bench.gpu import main as run

        return run(argv[1:])
    if argv[:1] == ["gpu-predict"]:
        from bench.gpu_predict import main as run

        return run(argv[1:])
    if argv[:1] == ["path"]:
        from bench.reading_path import main as run

        return run(argv[1:])
    if argv[:1] == ["emulate"]:
        from bench.emulate import main as run

        return run(argv[1:])
    if "--simulate" in argv:
        from bench.simulated import main as run

        return run([a for a in argv if a != "--simulate"])
    from bench.local import main as run

    return run(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
