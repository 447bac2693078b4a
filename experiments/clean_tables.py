r"""Remove the disk-tier table files that killed runs left behind.

    python -m experiments.clean_tables --workdir=runs/kaggle_disk            # one workdir's tables.tmp
    python -m experiments.clean_tables --workdir=runs/a,runs/b
    python -m experiments.clean_tables                                       # those in the system's temporary
                                                                             # directory

A run with `tiering.dir` "" keeps its disk tables in <workdir>/tables.tmp and removes them when it ends; a run killed
(kill -9, a crash of the machine) leaves them, and the next run or resume in the same workdir removes them first. This
removes them without a run. Without --workdir it looks in the system's temporary directory: the tables.tmp of the
launcher's own temporary workdirs (recjax_*, runs without --workdir) and the recjax-tiering-* folders of library
callers without a workdir. A folder a live run holds is kept (its owner is printed); folders named by `tiering.dir`
are the user's and never touched (recjax/tiering/folders.py).
"""

import pathlib

from absl import flags

from recjax import cli

_WORKDIRS = flags.DEFINE_list("workdir", [], "Workdirs whose left table folder to remove (none: those in the "
                              "system's temporary directory).")


def main(argv):
    if len(argv) > 1:
        cli.fail(f"unexpected arguments: {argv[1:]}")
    from recjax.tiering import folders

    workdirs = [pathlib.Path(w) for w in _WORKDIRS.value]
    for w in workdirs:
        if not w.is_dir():
            cli.fail(f"--workdir: {w} is not a directory")
    removed = total = 0
    for path in folders.stale_folders(workdirs):
        who = folders.owner(path)
        if who is not None:
            print(f"kept {path}: in use by {folders.describe_owner(who)}")
            continue
        size = folders.remove_stale(path)
        removed, total = removed + 1, total + size
        print(f"removed {path} ({size / 2**20:,.1f} MiB)")
    print(f"removed {removed} table folder{'s' if removed != 1 else ''}, {total / 2**20:,.1f} MiB")


if __name__ == "__main__":
    cli.run(main)
