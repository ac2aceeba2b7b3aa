"""The MegaKernel's deferred error checks in CUDA graphs, and its default on decode batches.

A call captured in a graph cannot copy its error words to the host at each replay, so it keeps
the first error of any replay in a device word (made by an eager call before capture) that
``check_errors()`` reads. The word logic (``torch.ops.uniep.keep_first_errors``) is checked here
on CPU tensors and, with a GPU, the CUDA kernel against them; the captured calls themselves run
in tests/gemm/test_gpu_prepared.py.
"""

from __future__ import annotations

import pytest
import torch
from uniep.moe.megakernel import launch

BAD_EXPERT = 1 << 48  # uniep/send_rows_error.hpp: kSendBadExpert << kSendErrorShift


def keep(sticky: torch.Tensor, word: torch.Tensor) -> None:
    torch.ops.uniep.keep_first_errors([sticky], [word])


@pytest.fixture(autouse=True)
def _no_sticky_words():
    launch._STICKY.clear()
    yield
    launch._STICKY.clear()


def test_the_first_error_of_any_replay_is_kept_and_raised_once() -> None:
    word = torch.zeros(1, dtype=torch.int64)
    sticky = launch.sticky_word("send", word, "moe_forward_local (fused)", 2)
    assert sticky is launch.sticky_word("send", word, "moe_forward_local (fused)", 2)
    keep(sticky, torch.zeros(1, dtype=torch.int64))  # a clean replay
    assert not sticky.any()
    keep(sticky, torch.tensor([BAD_EXPERT | 7]))  # entry 7: token 3, k 1
    keep(sticky, torch.tensor([BAD_EXPERT | 2]))  # a later one is not kept
    assert sticky.item() == BAD_EXPERT | 7
    with pytest.raises(ValueError, match=r"in a CUDA graph.*token 3, k 1"):
        launch.check_errors()
    assert not sticky.any(), "a raised error is cleared"
    launch.check_errors()  # nothing left


def test_a_timeout_record_is_kept_whole() -> None:
    record = torch.zeros(5, dtype=torch.int32)
    sticky = launch.sticky_word("gate", record, "moe_forward_local (fused)", 2)
    # flag 1: rows that never came (expert 3, m-tile 0, 5 of 8 rows).
    keep(sticky, torch.tensor([1, 3, 0, 5, 8], dtype=torch.int32))
    keep(sticky, torch.tensor([1, 4, 1, 0, 8], dtype=torch.int32))
    assert sticky.tolist() == [1, 3, 0, 5, 8]
    with pytest.raises(TimeoutError, match=r"in a CUDA graph.*expert 3, m-tile 0"):
        launch.check_errors()


def test_no_check_leaves_the_words_alone() -> None:
    sticky = launch.sticky_word("send", torch.zeros(1, dtype=torch.int64), "x", 1)
    keep(sticky, torch.tensor([BAD_EXPERT]))
    launch.check_errors(wait=False)  # the deferred calls' own check reads no device word
    assert sticky.item() == BAD_EXPERT


@pytest.mark.parametrize(
    "rows, experts, world, fused",
    [
        (8, 128, 1, True),  # one token, top-8 of 128 experts
        (64 * 128, 128, 1, True),  # one 64-row tile an expert on average
        (64 * 128 + 1, 128, 1, False),  # prefill: the separate launches
        (8, 128, 2, False),  # across ranks: the size agreement would cost a round trip a call
        (0, 128, 1, False),
    ],
)
def test_decode_batches_take_the_megakernel_by_default(
    rows: int, experts: int, world: int, fused: bool
) -> None:
    assert launch.fused_by_default(rows, experts, world) is fused


def test_the_tile_width_follows_the_rows() -> None:
    assert launch.fused_tile_n(64, 64 * 32, 32) == 128
    assert launch.fused_tile_n(64, 64 * 32 + 1, 32) == 256
    assert launch.fused_tile_n(128, 8, 32) == 256  # 128-row tiles are 256 wide
    # One token of top-8 on 132 SMs: 8 experts of FFN 2048 have 256 GEMM-1 tiles 128 wide (two
    # rounds) but 128 at 256 wide (one); of FFN 768, 96 tiles 128 wide (one round already).
    assert launch.fused_tile_n(64, 8, 256, ffn=2048, sms=132) == 256
    assert launch.fused_tile_n(64, 8, 128, ffn=768, sms=132) == 128
    # Two tokens (16 experts): FFN 768 then needs two rounds at 128 columns and one at 256;
    # FFN 2048 two or more at either width, so the decode tile stays.
    assert launch.fused_tile_n(64, 16, 128, ffn=768, sms=132) == 256
    assert launch.fused_tile_n(64, 16, 256, ffn=2048, sms=132) == 128
    assert launch.fused_tile_n(64, 128, 256, ffn=2048, sms=132) == 128
    assert launch.fused_tile_n(64, 8, 256, ffn=2048) == 128  # SMs unknown: no round check
    with pytest.raises(ValueError, match="must be >= 0"):
        launch.fused_tile_n(64, -1, 256)
    assert launch.fused_tile_shape(None, 128) == (64, 128)
    assert launch.fused_tile_shape(64, None) == (64, 0)
    with pytest.raises(ValueError, match="tile_n=128 runs 64-row tiles"):
        launch.fused_tile_shape(128, 128)
    with pytest.raises(ValueError, match="tile_n must be None or"):
        launch.fused_tile_shape(64, 128, "sequential")


def test_one_check_clears_every_word_of_the_failed_replays() -> None:
    plan = launch.sticky_word("send", torch.zeros(1, dtype=torch.int64), "call (plan)", 2)
    kernel = launch.sticky_word("gate", torch.zeros(5, dtype=torch.int32), "call (fused)", 2)
    keep(plan, torch.tensor([BAD_EXPERT | 1]))
    keep(kernel, torch.tensor([1, 0, 0, 0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"call \(plan\) \(in a CUDA graph\)"):
        launch.check_errors()  # the plan's, made first
    assert not plan.any() and not kernel.any()
    launch.check_errors()


def test_fp8_eager_calls_make_the_words_a_later_capture_keeps() -> None:
    # moe_forward_prepared's small eager fp8 calls take the dispatch; the capture that may follow
    # takes uniep.moe.fp8_local, whose words must exist by then (made once, kept after).
    from uniep.moe import fp8_local

    device = torch.device("cpu")
    fp8_local.keep_graph_errors(device, 4)
    made = {key[1]: word for key, word in launch._STICKY.items() if key[2] == 4}
    # One word, the plan's: the quantize and the combine take its rows and report nothing.
    assert set(made) == {"moe_forward_prepared (fp8 plan)"}
    assert all(w.dtype == torch.int64 and not w.any() for w in made.values())
    fp8_local.keep_graph_errors(device, 4)
    assert all(launch._STICKY[("send", what, 4, device)] is w for what, w in made.items())


def test_one_call_keeps_every_word_and_checks_its_arguments() -> None:
    send = torch.tensor([BAD_EXPERT | 3])
    kept = torch.tensor([BAD_EXPERT | 9])
    gate = torch.zeros(5, dtype=torch.int32)
    torch.ops.uniep.keep_first_errors(
        [send, kept, gate],
        [torch.tensor([BAD_EXPERT | 4]), torch.zeros(1, dtype=torch.int64), _timeout_record()],
    )
    assert send.item() == BAD_EXPERT | 3 and kept.item() == BAD_EXPERT | 9  # errors kept before
    assert gate.tolist() == _timeout_record().tolist()
    one = torch.zeros(1, dtype=torch.int64)
    bad = [
        (([one], []), "sticky and words must be as long, got 1 and 0"),
        (([one], [torch.zeros(1)]), r"words\[0\] must be int32 or int64"),
        (([one], [torch.zeros(1, dtype=torch.int32)]), r"sticky\[0\] must be words\[0\]'s Int"),
        (([one], [torch.zeros(2, dtype=torch.int64)]), "the same number"),
        (([one[:0]], [one[:0]]), r"the same number \(>= 1\) of elements, got 0 and 0"),
    ]
    for args, message in bad:
        with pytest.raises(ValueError, match=message):
            torch.ops.uniep.keep_first_errors(*args)


def _timeout_record() -> torch.Tensor:
    return torch.tensor([1, 3, 0, 5, 8], dtype=torch.int32)


@pytest.mark.gpu
def test_the_cuda_kernel_keeps_what_the_cpu_keeps() -> None:
    # Twenty pairs (two launches of at most 16), each sticky word clean or already holding an
    # error, of both dtypes and several lengths.
    gen = torch.Generator().manual_seed(0)
    sticky, words = [], []
    for i in range(20):
        dtype = torch.int64 if i % 3 else torch.int32
        n = 1 + i % 6
        s = torch.randint(1, 1000, (n,), generator=gen).to(dtype)
        if i % 2:
            s.zero_()
        sticky.append(s)
        words.append(torch.randint(0, 1000, (n,), generator=gen).to(dtype))
    cpu = [s.clone() for s in sticky]
    torch.ops.uniep.keep_first_errors(cpu, words)
    gpu = [s.cuda() for s in sticky]
    torch.ops.uniep.keep_first_errors(gpu, [w.cuda() for w in words])
    for i, (c, g) in enumerate(zip(cpu, gpu, strict=True)):
        assert torch.equal(c, g.cpu()), f"pair {i}"
    with pytest.raises(ValueError, match=r"sticky\[1\] and words\[1\] must be on"):
        torch.ops.uniep.keep_first_errors([gpu[0], gpu[1]], [words[0].cuda(), words[1]])


def test_threads_checking_at_once_take_each_call_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two threads of a server in check_errors together: every pending call's words are read by
    exactly one (the list was popped unlocked: a call could be dropped unread, or the pop fail)."""
    import threading
    import time

    class Passed:  # a recorded event whose work is done; its host wait takes a moment
        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            time.sleep(0.001)

    read: list[str] = []
    monkeypatch.setattr(launch, "_raise_from", lambda entries: read.extend(entries))
    for _ in range(50):
        read.clear()
        monkeypatch.setattr(launch, "_PENDING", [(Passed(), [f"call{i}"]) for i in range(4)])
        failures: list[BaseException] = []

        def check(failures: list[BaseException] = failures) -> None:
            try:
                launch.check_errors(wait=False)
            except BaseException as e:  # noqa: BLE001
                failures.append(e)

        threads = [threading.Thread(target=check) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not failures and sorted(read) == [f"call{i}" for i in range(4)], (read, failures)
