"""A tensor-parallel worker: one rank above 0, in its own process (`python -m hybridmoe.distributed.worker FD`, started
by distributed/launcher.py; FD is its end of the pipe to rank 0).

It reads its WorkerArgs, joins the group, loads its shard of the model (no routed expert: rank 0 holds them all),
reports what it holds, then runs each message of rank 0 on its shard until Stop. It exits 0 on Stop or when rank 0
is gone (its pipe closes); on any failure it sends ("error", the reason in one line) before it leaves the group, so
that rank 0, whose next collective fails as the group loses this rank, can say why. Ctrl-C is rank 0's to handle:
the worker ignores SIGINT (the terminal sends it to every process of the foreground group).
"""

from __future__ import annotations

import signal
import sys
from multiprocessing.connection import Connection

import torch

from hybridmoe.distributed.messages import RankReport, Stop, WorkerArgs, rank_report
from hybridmoe.distributed.parallel_state import join_group, leave_group


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(int(argv[1]))
    try:
        serve(conn, conn.recv())
    except EOFError:  # rank 0 is gone: nobody to report to
        return 0
    except BaseException as e:  # noqa: BLE001 (whatever stops this rank, rank 0 gets the reason)
        _report(conn, f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"[:500])
        return 1
    finally:
        leave_group()
    return 0


def serve(conn: Connection, args: WorkerArgs) -> None:
    torch.set_num_threads(args.threads)
    conn.send(("joining", args.rank))
    tp = join_group(args.rank, args.world_size, args.init_file, torch.device(args.engine_config.device))
    model = args.load(args.model_dir, args.engine_config, tp).model
    report: RankReport = rank_report(model, tp.rank)
    conn.send(("ready", report))
    with torch.inference_mode():
        while not isinstance(message := conn.recv(), Stop):
            message.run(model, tp)


def _report(conn: Connection, reason: str) -> None:
    try:
        conn.send(("error", reason))
    except OSError:  # rank 0 is gone
        pass


if __name__ == "__main__":
    sys.exit(main(sys.argv))
