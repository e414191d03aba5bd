"""The pure device rules: CUDA_VISIBLE_DEVICES, sizes, capabilities."""

from __future__ import annotations

import fnmatch

import pytest

from gpumagic.devices import (
    CudaStatus,
    DeviceInfo,
    DeviceSpec,
    DeviceSpecError,
    parse_device_spec,
    parse_visible_devices,
    pick_devices,
    select_visible,
)
from gpumagic.units import format_bytes, parse_capability, parse_size

BOARDS = [
    DeviceInfo(i, f"GPU{i}", 80 * 2**30, (9, 0), uuid=f"GPU-{i}aaa-{i}", physical_index=i)
    for i in range(3)
]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", []),
        ("0", [0]),
        ("1,0", [1, 0]),
        (" 2 , 0 ", [2, 0]),
        ("0,x,1", [0]),
        ("-1", []),
        ("0,0", []),
        ("GPU-1aaa,GPU-0aaa", ["GPU-1aaa", "GPU-0aaa"]),
        ("GPU-1aaa,2", ["GPU-1aaa"]),
        ("MIG-abc", ["MIG-abc"]),
    ],
)
def test_parse_visible_devices(value: str | None, expected: object) -> None:
    assert parse_visible_devices(value) == expected


def test_select_visible_renumbers_in_the_given_order() -> None:
    chosen = select_visible(BOARDS, [2, 0])
    assert [(d.index, d.physical_index) for d in chosen] == [(0, 2), (1, 0)]


def test_select_visible_stops_at_an_index_past_the_last_board() -> None:
    assert [d.physical_index for d in select_visible(BOARDS, [1, 7, 0])] == [1]


def test_select_visible_by_uuid_prefix() -> None:
    chosen = select_visible(BOARDS, ["GPU-2", "GPU-0aaa"])
    assert [d.physical_index for d in chosen] == [2, 0]


def test_select_visible_ambiguous_uuid_prefix_ends_the_list() -> None:
    assert select_visible(BOARDS, ["GPU-"]) == []


def test_unset_means_every_board() -> None:
    assert [d.index for d in select_visible(BOARDS, None)] == [0, 1, 2]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (4096, 4096),
        ("512MiB", 512 * 2**20),
        ("40 GiB", 40 * 2**30),
        ("1.5GB", 1_500_000_000),
        ("7", 7),
        ("2kb", 2000),
    ],
)
def test_parse_size(value: int | str, expected: int) -> None:
    assert parse_size(value) == expected


@pytest.mark.parametrize("value", ["lots", "12 parsecs", -1, "", True])
def test_parse_size_rejects_with_the_accepted_forms(value: object) -> None:
    with pytest.raises(ValueError, match=r"not a memory size|negative"):
        parse_size(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "expected"),
    [((8, 0), (8, 0)), ("8.6", (8, 6)), ("sm_90", (9, 0)), ("sm_100", (10, 0)), (9.0, (9, 0))],
)
def test_parse_capability(value: object, expected: tuple[int, int]) -> None:
    assert parse_capability(value) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["ampere", (8,), (8, -1), "8.x"])
def test_parse_capability_rejects(value: object) -> None:
    with pytest.raises(ValueError, match="compute capability"):
        parse_capability(value)  # type: ignore[arg-type]


def test_format_bytes() -> None:
    assert format_bytes(0) == "0 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(-256 * 2**20) == "-256.0 MiB"
    assert format_bytes(80 * 2**30) == "80.0 GiB"


def test_status_summary_says_why_when_unavailable() -> None:
    status = CudaStatus(False, "torch 2.13.0+cpu was built without CUDA", torch_version="2.13.0")
    assert status.summary() == (
        "torch 2.13.0; no usable GPU: torch 2.13.0+cpu was built without CUDA"
    )


def test_device_describe() -> None:
    assert BOARDS[0].describe() == "0 GPU0 (80.0 GiB, sm_90)"


# ---------------------------------------------------------------------------
# The device-spec grammar shared by %cudatime, %gpumem and --cuda-devices


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", DeviceSpec((0,))),
        ("cuda:1", DeviceSpec((1,))),
        (" CUDA:1 , 0 ", DeviceSpec((1, 0))),
        ("all", DeviceSpec(None)),
        ("ALL", DeviceSpec(None)),
        ("cpu", DeviceSpec(None, cpu=True)),
    ],
)
def test_device_spec_grammar(text: str, expected: DeviceSpec) -> None:
    assert parse_device_spec(text, where="--x", place="x", cpu=True) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "--x: no device given; use indices into the visible devices such as 0 or "
         "cuda:0, a list such as 0,1 or 'all'"),
        ("gpu0", "--x: 'gpu0' is not a device index; use indices *"),
        ("0,,1", "--x: '' is not a device index; *"),
        ("-1", "--x: '-1' is not a device index; *"),
        ("cuda", "--x: 'cuda' is not a device index; *"),
        ("0,cuda:0", "--x: cuda:0 is listed twice"),
        ("cpu", "--x: %gpumem takes CUDA devices only, not cpu; use indices *"),
    ],
)  # fmt: skip
def test_device_spec_errors(text: str, message: str) -> None:
    with pytest.raises(DeviceSpecError) as raised:
        parse_device_spec(text, where="--x", place="%gpumem")
    assert fnmatch.fnmatchcase(str(raised.value), message), str(raised.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0,1", "--x: %cudatime takes one device, not a list; use one index into the visible "
         "devices such as 0 or cuda:0 or cpu"),
        ("all", "--x: %cudatime takes one device, not all; *"),
        ("1,1", "--x: cuda:1 is listed twice"),
    ],
)  # fmt: skip
def test_a_place_for_one_device_says_so(text: str, message: str) -> None:
    with pytest.raises(DeviceSpecError) as raised:
        parse_device_spec(text, where="--x", place="%cudatime", many=False, cpu=True)
    assert fnmatch.fnmatchcase(str(raised.value), message), str(raised.value)


def test_pick_devices_in_the_order_given() -> None:
    visible = BOARDS[:2]
    assert pick_devices(visible, DeviceSpec((1, 0)), where="--x") == (visible[1], visible[0])
    assert pick_devices(visible, DeviceSpec(None), where="--x") == tuple(visible)
    with pytest.raises(DeviceSpecError, match=r"--x: there is no cuda:2, cuda:5 here \(visible: "):
        pick_devices(visible, DeviceSpec((2, 0, 5)), where="--x")
    with pytest.raises(DeviceSpecError, match=r"\(visible: none\)"):
        pick_devices((), DeviceSpec((0,)), where="--x")
