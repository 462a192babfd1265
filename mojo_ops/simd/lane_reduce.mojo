"""Reductions across SIMD lanes of many vectors at once (a transposed
reduction), for dot products and row maxima."""

from std.bit import log2_floor, next_power_of_two
from std.memory import stack_allocation
from std.utils import IndexList

from .widen import F32, W


def _pair_mask[gs: Int, hi: Bool]() -> IndexList[W]:
    """Lanes of concat(x, y) that `combine_pairs` combines: the low (or high)
    halves of x's and then y's groups of gs lanes."""
    var mask = IndexList[W]()
    comptime half = gs // 2
    comptime groups = W // gs
    for i in range(W):
        var group = i // half
        var src = (group % groups) * gs + (group // groups) * W
        mask[i] = src + i % half + (half if hi else 0)
    return mask


@always_inline
def combine[
    is_max: Bool, width: Int
](x: SIMD[F32, width], y: SIMD[F32, width]) -> SIMD[F32, width]:
    comptime if is_max:
        return max(x, y)
    else:
        return x + y


@always_inline
def combine_pairs[
    gs: Int, is_max: Bool
](x: SIMD[F32, W], y: SIMD[F32, W]) -> SIMD[F32, W]:
    """Combines lane pairs: x and y hold groups of gs lanes; the result holds
    x's then y's groups, each reduced to gs / 2 lanes."""
    comptime lo = _pair_mask[gs, False]()
    comptime hi = _pair_mask[gs, True]()
    return combine[is_max](x.shuffle[lo](y), x.shuffle[hi](y))


@always_inline
def reduce_many[
    count: Int, is_max: Bool = False
](v: Pointer[mut=True, SIMD[F32, W], _]) -> SIMD[F32, count]:
    """The lane sums (or maxima) of count vectors, as one vector (lane i
    reduces v[i]); v is overwritten. count is a power of two (a SIMD
    vector's length is one): `reduce_padded` takes any.

    A transposed reduction: log2(count) levels of pairwise shuffles, then
    in-vector halving, instead of count separate horizontal reductions.
    """
    comptime if count == 1:
        comptime if is_max:
            return SIMD[F32, count](v[unsafe_offset=0].reduce_max())
        else:
            return SIMD[F32, count](v[unsafe_offset=0].reduce_add())
    elif count > W:
        # More vectors than lanes (NEON's 4 lanes against a tile of 8 rows):
        # W at a time. x86 tiles never take this.
        comptime assert count % W == 0, "count a multiple of W"
        var sums = SIMD[F32, count]()
        comptime for b in range(count // W):
            var part = reduce_many[W, is_max](v.unsafe_offset(b * W))
            comptime for i in range(W):
                sums[b * W + i] = part[i]
        return sums
    else:
        comptime levels = log2_floor(count)
        comptime for level in range(levels):
            comptime gs = W >> level
            comptime stride = 1 << level
            comptime for i in range(0, count, 2 * stride):
                v[unsafe_offset=i] = combine_pairs[gs, is_max](
                    v[unsafe_offset=i], v[unsafe_offset=i + stride]
                )
        var x = v[unsafe_offset=0]
        comptime for _ in range(log2_floor(W) - levels):
            var halves = x.deinterleave()
            var reduced = halves[0] + halves[1]
            comptime if is_max:
                reduced = max(halves[0], halves[1])
            # Only the low lanes matter from here on.
            x = rebind[SIMD[F32, W]](reduced.join(reduced))
        return x.slice[count]()


@always_inline
def reduce_padded[
    count: Int
](v: Pointer[mut=True, SIMD[F32, W], _]) -> SIMD[F32, next_power_of_two(count)]:
    """`reduce_many`'s lane sums of any count of vectors, at most W (a tile of
    3 rows' dots): those of count rounded up to a power of two, the extra
    vectors zeros, so lanes past count are 0; v may be overwritten."""
    comptime lanes = next_power_of_two(count)
    comptime if lanes == count:
        return rebind[SIMD[F32, lanes]](reduce_many[count](v))
    else:
        comptime assert lanes <= W, "padded vectors fit one vector's lanes"
        var all = stack_allocation[lanes, SIMD[F32, W]]()
        comptime for i in range(lanes):
            comptime if i < count:
                all[unsafe_offset=i] = v[unsafe_offset=i]
            else:
                all[unsafe_offset=i] = 0
        return reduce_many[lanes](all)
