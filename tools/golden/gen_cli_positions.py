#!/usr/bin/env python3
"""Inputs of the `rpe buckets/term --positions` CLI tests (tests/data/cli/positions), made from
the golden cases without numpy (plain .npy v1.0 reader and writer, C order):

- grid_7x7.npy       int64 (49, 2): the (row, col) of a 7x7 grid in token order (= the grid's ids)
- perm_7x7.npy       int32 (49, 2): the same in a fixed shuffled order (seed 7)
- ids_perm_7x7.npy   int32 (50, 50): golden bucket_ids/product_7x7_skip1_r1.9 with tokens permuted
- perm_5x9.npy       int32 (45, 2): a 5x9 grid in a fixed shuffled order (seed 9)
- x_perm_5x9.npy, output_perm_5x9.npy: golden term/product_ctx_k_shared_5x9_skip1_r1.9 x and output
  with tokens permuted the same way (token i of the permuted layout is grid token perm[i - 1] + 1)
- float_7x7.npy      float32 (49, 2): grid_7x7 as floats (refused: positions are integers)
- cols4.npy          int32 (3, 4): a shape the tool refuses
- q20_7x7.npy, k29_7x7.npy  int32 (20, 2), (29, 2): the first 20 and the last 29 tokens of
  perm_7x7 (queries and keys of different counts, `rpe buckets --key-positions`)
- ids_q20_k29_7x7.npy int32 (21, 30): the golden ids' rows of those queries and columns of those
  keys (skip token first in both): the (L, L_k) ids are self-attention's over both sets, restricted
- output_q20_k29_7x7.npy float32 (1, 3, 21, 30): golden term/product_bias_k_unshared_7x7_skip1_r1.9
  output's rows of those queries and columns of those keys (`rpe term --key-positions`)
- hand case of `rpe term --key-positions` (values written here, checked by hand; product, ratio
  1.9: |offsets| <= 1 fall in bucket (dr + 3) * 7 + (dc + 3), the skip bucket is 49):
  q2_hand.npy int32 (2, 2) queries (0, 0), (1, 1); k3_hand.npy int32 (3, 2) keys (0, 0), (0, 1),
  (1, 0); ids_table_bias.npy (1, 50) and ids_table_ctx.npy (1, 1, 50) float32 with table[k] = k;
  x_q_hand.npy (1, 1, 4, 1) float32 = 1, 2, 3, 4 (the keys' k*s, skip token first);
  out_bias_k_hand.npy (1, 1, 3, 4): bias on k, the key target's ids (offset q - k);
  out_ctx_q_hand.npy (1, 1, 3, 4): contextual on q, x_j times the query target's ids (offset k - q);
  ids_table_v.npy (1, 50, 1) float32 with table[k] = k, x_v_hand.npy (1, 1, 3, 4) float32 of ones
  and out_ctx_v_hand.npy (1, 1, 3, 1): contextual on v, each row's sum of the key target's ids
- grid_3x4.npy       int32 (12, 2): a 3x4 grid (`rpe buckets` with a large --skip counts its
  buckets over the position pairs, as with --grid 3x4)
- grid_2x3x4.npy     int32 (24, 3): the (t, row, col) of a 2x3x4 grid (a 2x3x4 box)
- span_21x21.npy     int32 (2, 2): (0, 0) and (20, 20), a 21x21 box (beyond a 3x3 Swin window)
- empty.npy          int32 (0, 2): no tokens (refused)
- fortran_3x4.npy    int32 (12, 2) in Fortran order, bigendian_3x4.npy >i4 (12, 2): grid_3x4
  in layouts the .npy reader refuses (refused as --positions files, status 2)
- `rpe rope --positions` and float32's exact integers (|value| <= 2^24):
  rope_at_2p24.npy int64 (2, 2) (-2^24, 0), (2^24, 1) (taken), rope_at_2p24_f4.npy the same in
  float32 (exact: the integer file's rotation must equal it), rope_beyond_2p24.npy int64 (2, 2)
  (0, 0), (2^24 + 1, 1) and rope_beyond_neg_2p24.npy int32 (2, 2) (0, 0), (1, -(2^24 + 1))
  (refused, status 2: float32 would read 2^24 + 1 as 2^24); x_rope_2.npy float32 (1, 1, 2, 4)
  the q they rotate (values 1..8)

Run from the repository root: python3 tools/golden/gen_cli_positions.py
"""
import ast
import random
import struct

GOLDEN = "tests/data/golden"
OUT = "tests/data/cli/positions"
FMT = {"<f4": "f", "<i4": "i", "<i8": "q", ">i4": "i"}


def load(path):
    with open(path, "rb") as f:
        data = f.read()
    assert data[:6] == b"\x93NUMPY" and data[6] == 1
    n = struct.unpack("<H", data[8:10])[0]
    header = ast.literal_eval(data[10:10 + n].decode("latin1"))
    assert not header["fortran_order"]
    shape, code = header["shape"], FMT[header["descr"]]
    count = 1
    for e in shape:
        count *= e
    values = list(struct.unpack("<%d%s" % (count, code), data[10 + n:10 + n + count * struct.calcsize(code)]))
    return header["descr"], tuple(shape), values


def save(path, descr, shape, values, fortran=False):
    """values in C order; fortran=True writes them in Fortran order (and says so in the header)"""
    if fortran:
        rows, cols = shape
        values = [values[r * cols + c] for c in range(cols) for r in range(rows)]
    header = "{'descr': '%s', 'fortran_order': %s, 'shape': %s, }" % (descr, fortran, repr(tuple(shape)))
    pad = 64 - (10 + len(header) + 1) % 64
    header = header + " " * (pad % 64) + "\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode("latin1"))
        f.write(struct.pack("%s%d%s" % (descr[0], len(values), FMT[descr]), *values))


def grid(h, w):
    return [v for r in range(h) for c in range(w) for v in (r, c)]


def perm_of(n, seed):
    p = list(range(n))
    random.Random(seed).shuffle(p)
    return p


def permuted_rows(coords, perm):
    return [v for i in perm for v in coords[2 * i:2 * i + 2]]


def source(i, skip, perm):
    return i if i < skip else skip + perm[i - skip]


def main():
    save(f"{OUT}/grid_7x7.npy", "<i8", (49, 2), grid(7, 7))
    p7 = perm_of(49, 7)
    save(f"{OUT}/perm_7x7.npy", "<i4", (49, 2), permuted_rows(grid(7, 7), p7))
    _, shape, ids = load(f"{GOLDEN}/bucket_ids/product_7x7_skip1_r1.9/bucket_ids.npy")
    n = shape[0]
    save(f"{OUT}/ids_perm_7x7.npy", "<i4", shape,
         [ids[source(i, 1, p7) * n + source(j, 1, p7)] for i in range(n) for j in range(n)])
    p9 = perm_of(45, 9)
    save(f"{OUT}/perm_5x9.npy", "<i4", (45, 2), permuted_rows(grid(5, 9), p9))
    case = f"{GOLDEN}/term/product_ctx_k_shared_5x9_skip1_r1.9"
    _, (b, h, l, d), x = load(f"{case}/x.npy")
    save(f"{OUT}/x_perm_5x9.npy", "<f4", (b, h, l, d),
         [x[(p * l + source(i, 1, p9)) * d + e] for p in range(b * h) for i in range(l) for e in range(d)])
    _, (b, h, l, _), out = load(f"{case}/output.npy")
    save(f"{OUT}/output_perm_5x9.npy", "<f4", (b, h, l, l),
         [out[(p * l + source(i, 1, p9)) * l + source(j, 1, p9)] for p in range(b * h) for i in range(l) for j in range(l)])
    save(f"{OUT}/float_7x7.npy", "<f4", (49, 2), [float(v) for v in grid(7, 7)])
    save(f"{OUT}/cols4.npy", "<i4", (3, 4), list(range(12)))
    # queries and keys of different counts: two parts of the shuffled 7x7 grid
    qp, kp = p7[:20], p7[20:]
    save(f"{OUT}/q20_7x7.npy", "<i4", (20, 2), permuted_rows(grid(7, 7), qp))
    save(f"{OUT}/k29_7x7.npy", "<i4", (29, 2), permuted_rows(grid(7, 7), kp))
    save(f"{OUT}/ids_q20_k29_7x7.npy", "<i4", (21, 30),
         [ids[source(i, 1, qp) * n + source(j, 1, kp)] for i in range(21) for j in range(30)])
    _, (_, h, l, _), out = load(f"{GOLDEN}/term/product_bias_k_unshared_7x7_skip1_r1.9/output.npy")
    save(f"{OUT}/output_q20_k29_7x7.npy", "<f4", (1, h, 21, 30),
         [out[(p * l + source(i, 1, qp)) * l + source(j, 1, kp)] for p in range(h) for i in range(21) for j in range(30)])
    # the hand case: skip 1, L = 3, L_k = 4
    save(f"{OUT}/q2_hand.npy", "<i4", (2, 2), [0, 0, 1, 1])
    save(f"{OUT}/k3_hand.npy", "<i4", (3, 2), [0, 0, 0, 1, 1, 0])
    save(f"{OUT}/ids_table_bias.npy", "<f4", (1, 50), [float(k) for k in range(50)])
    save(f"{OUT}/ids_table_ctx.npy", "<f4", (1, 1, 50), [float(k) for k in range(50)])
    save(f"{OUT}/x_q_hand.npy", "<f4", (1, 1, 4, 1), [1.0, 2.0, 3.0, 4.0])
    # key target, offset q - k: q (0, 0) to keys (0, 0), (0, 1), (1, 0): offsets (0, 0), (0, -1),
    # (-1, 0): 24, 23, 17; q (1, 1): (1, 1), (1, 0), (0, 1): 32, 31, 25
    save(f"{OUT}/out_bias_k_hand.npy", "<f4", (1, 1, 3, 4),
         [49.0, 49.0, 49.0, 49.0, 49.0, 24.0, 23.0, 17.0, 49.0, 32.0, 31.0, 25.0])
    # query target, offset k - q: q (0, 0): 24, 25, 31; q (1, 1): (-1, -1), (-1, 0), (0, -1): 16,
    # 17, 23; times x_j = 1, 2, 3, 4 (column j)
    save(f"{OUT}/out_ctx_q_hand.npy", "<f4", (1, 1, 3, 4),
         [49.0, 98.0, 147.0, 196.0, 49.0, 48.0, 75.0, 124.0, 49.0, 32.0, 51.0, 92.0])
    # value target (key target's ids), x = 1: row sums 4 * 49, 49 + 24 + 23 + 17, 49 + 32 + 31 + 25
    save(f"{OUT}/ids_table_v.npy", "<f4", (1, 50, 1), [float(k) for k in range(50)])
    save(f"{OUT}/x_v_hand.npy", "<f4", (1, 1, 3, 4), [1.0] * 12)
    save(f"{OUT}/out_ctx_v_hand.npy", "<f4", (1, 1, 3, 1), [196.0, 113.0, 137.0])
    # CLI review cases
    save(f"{OUT}/grid_3x4.npy", "<i4", (12, 2), grid(3, 4))
    save(f"{OUT}/grid_2x3x4.npy", "<i4", (24, 3), [v for t in range(2) for r in range(3) for c in range(4) for v in (t, r, c)])
    save(f"{OUT}/span_21x21.npy", "<i4", (2, 2), [0, 0, 20, 20])
    save(f"{OUT}/empty.npy", "<i4", (0, 2), [])
    save(f"{OUT}/fortran_3x4.npy", "<i4", (12, 2), grid(3, 4), fortran=True)
    save(f"{OUT}/bigendian_3x4.npy", ">i4", (12, 2), grid(3, 4))
    # rope --positions: float32 reads integers exactly up to 2^24 only
    e = 1 << 24
    save(f"{OUT}/rope_at_2p24.npy", "<i8", (2, 2), [-e, 0, e, 1])
    save(f"{OUT}/rope_at_2p24_f4.npy", "<f4", (2, 2), [float(-e), 0.0, float(e), 1.0])
    save(f"{OUT}/rope_beyond_2p24.npy", "<i8", (2, 2), [0, 0, e + 1, 1])
    save(f"{OUT}/rope_beyond_neg_2p24.npy", "<i4", (2, 2), [0, 0, 1, -(e + 1)])
    save(f"{OUT}/x_rope_2.npy", "<f4", (1, 1, 2, 4), [float(v) for v in range(1, 9)])


if __name__ == "__main__":
    main()
