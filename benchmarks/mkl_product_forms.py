"""Two other ways to hand a prefill's fp32 products to MKL, against the calls the engine
makes (decode_layers.cpp's kTorchGemm: torch's own `sgemm_`, one call per product of q, k,
v, o, gate, up and down), on SmolLM2's shapes, 30 layers of distinct weights (read from
memory, as in a forward), in one process, alternated; prints whether each way gives the
engine's bits and the medians of its time.

- `packed`: MKL's packed-operand API (`SGEMM_PACK` once per weight, then `SGEMM_COMPUTE`
  with the weight as the packed operand), exported by torch's libtorch_cpu.so beside
  `sgemm_`: MKL then skips copying the weight into its panels at every call.
- `merged`: q, k and v as one product over the three weights stacked (960 x 576), gate and
  up as one (3,072 x 576) instead of two (GatedMLP._local's prefill form): x is read and
  packed once instead of three times and twice.

Both give the engine's bits (an output's sum does not depend on the other outputs of its
call). Neither was taken: the packed form, built into the driver, sped whole mixed steps up
~2% for 644 MB more memory; the merged products were slower. See benchmarks/README.md
(thirty-eighth session).

    .venv/bin/python benchmarks/mkl_product_forms.py --rows 544 870 1024
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from radixserve.hardware import cpu_info
from radixserve.model.cpu_kernels import function_address
from radixserve.model.decode_layers import torch_sgemm_address

LAYERS = 30
HIDDEN, INTER, Q_WIDTH, KV_WIDTH = 576, 1536, 576, 192  # SmolLM2-135M
PRODUCTS = {  # name: (features, columns)
    "q": (Q_WIDTH, HIDDEN),
    "k": (KV_WIDTH, HIDDEN),
    "v": (KV_WIDTH, HIDDEN),
    "gate": (INTER, HIDDEN),
    "up": (INTER, HIDDEN),
    "down": (HIDDEN, INTER),
}

Int, Float, Ptr = ctypes.c_int, ctypes.c_float, ctypes.c_void_p


def ref(value: int | float) -> ctypes._CArgObject:
    return ctypes.byref(Int(value) if isinstance(value, int) else Float(value))


class Mkl:
    """torch's MKL through its Fortran entry points, as F.linear calls sgemm for x (m, k)
    @ w.T: out^T (n x m) = w (n x k, transposed) . x^T, column-major."""

    def __init__(self) -> None:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        engine = torch_sgemm_address()  # the sgemm the engine's large steps call
        if engine is None or function_address(lib.sgemm_) != engine:
            raise SystemExit("torch's F.linear reaches no sgemm_ of libtorch_cpu.so here")
        self.sgemm, self.pack, self.compute = lib.sgemm_, lib.SGEMM_PACK, lib.SGEMM_COMPUTE
        self.pack_size = lib.SGEMM_PACK_GET_SIZE
        self.pack_size.restype = ctypes.c_size_t

    def product(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self._call(self.sgemm, b"T", w, x, w.shape[0])

    def packed(self, w: torch.Tensor, rows: int) -> torch.Tensor:
        n, k = w.shape
        size = self.pack_size(b"A", ref(n), ref(rows), ref(k))
        buffer = torch.empty(size // 4 + 16)
        self.pack(
            b"A", b"T", ref(n), ref(rows), ref(k), ref(1.0), Ptr(w.data_ptr()), ref(k),
            Ptr(buffer.data_ptr()),
        )  # fmt: skip
        return buffer

    def packed_product(self, x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
        return self._call(self.compute, b"P", packed, x, n)

    @staticmethod
    def _call(fn, transa: bytes, a: torch.Tensor, x: torch.Tensor, n: int) -> torch.Tensor:
        """out (m, n) = op(a) . x^T, transposed; sgemm takes alpha (1) where sgemm_compute
        takes none."""
        m, k = x.shape
        out = torch.empty(m, n)
        alpha = [] if transa == b"P" else [ref(1.0)]
        fn(
            transa, b"N", ref(n), ref(m), ref(k), *alpha, Ptr(a.data_ptr()), ref(k),
            Ptr(x.data_ptr()), ref(k), ref(0.0), Ptr(out.data_ptr()), ref(n),
        )  # fmt: skip
        return out


def time_into(fn: Callable[[], object], times: list[float]) -> None:
    start = time.perf_counter()
    fn()
    times.append((time.perf_counter() - start) * 1e3)


def timed_ways(mkl: Mkl, x, inputs, weights, packed, qkv, gate_up) -> dict[str, Callable]:
    """Each way of running a forward's products of these rows, by name."""
    return {
        "engine (all six)": lambda: [
            mkl.product(inputs[n], w) for n, ws in weights.items() for w in ws
        ],
        "packed (all six)": lambda: [
            mkl.packed_product(inputs[n], p, PRODUCTS[n][0]) for n, ps in packed.items() for p in ps
        ],
        "engine q, k, v": lambda: [mkl.product(x, w) for p in "qkv" for w in weights[p]],
        "merged qkv": lambda: [mkl.product(x, w) for w in qkv],
        "engine gate, up": lambda: [mkl.product(x, w) for p in ("gate", "up") for w in weights[p]],
        "merged gate_up": lambda: [mkl.product(x, w) for w in gate_up],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[544, 870, 1024])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(cpu_info().summary(), flush=True)
    mkl = Mkl()
    torch.manual_seed(0)
    weights = {
        name: [torch.randn(*shape) for _ in range(LAYERS)] for name, shape in PRODUCTS.items()
    }
    qkv = [torch.cat([weights[p][i] for p in "qkv"]) for i in range(LAYERS)]
    gate_up = [torch.cat([weights["gate"][i], weights["up"][i]]) for i in range(LAYERS)]
    for rows in args.rows:
        x, x_inter = torch.randn(rows, HIDDEN), torch.randn(rows, INTER)
        inputs = {name: x_inter if name == "down" else x for name in PRODUCTS}
        packed = {name: [mkl.packed(w, rows) for w in ws] for name, ws in weights.items()}
        same_packed = all(
            torch.equal(
                mkl.packed_product(inputs[n], packed[n][0], PRODUCTS[n][0]),
                mkl.product(inputs[n], weights[n][0]),
            )
            for n in PRODUCTS
        )
        same_merged = torch.equal(
            mkl.product(x, qkv[0]), torch.cat([mkl.product(x, weights[p][0]) for p in "qkv"], 1)
        ) and torch.equal(
            mkl.product(x, gate_up[0]),
            torch.cat([mkl.product(x, weights[p][0]) for p in ("gate", "up")], 1),
        )
        assert torch.equal(mkl.product(x, weights["q"][0]), F.linear(x, weights["q"][0]))
        ways = timed_ways(mkl, x, inputs, weights, packed, qkv, gate_up)
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.repeats):
            for name, fn in ways.items():
                time_into(fn, times[name])
        med = {name: statistics.median(t) for name, t in times.items()}
        print(f"{rows} rows: packed gives the engine's bits: {same_packed}; merged: {same_merged}")
        for base, other in (
            ("engine (all six)", "packed (all six)"),
            ("engine q, k, v", "merged qkv"),
            ("engine gate, up", "merged gate_up"),
        ):
            print(
                f"  {base:18} {med[base]:8.1f} ms -> {other:18} {med[other]:8.1f} ms"
                f"  ({med[base] / med[other]:.3f}x)",
                flush=True,
            )


if __name__ == "__main__":
    main()
