//! A vector split over the ranks ([`Shards`]), and the two collectives that sharded trainer
//! state runs on, in buckets: the reduce-scatter of a gradient vector and the all-gather of
//! the updated parameters. The vector is held as pieces (one per parameter, in the model's
//! order) and read as one: no whole copy of it is ever made.

use super::contract::{Collective, ReduceDtype};
use std::ops::Range;

/// How `len` values are split over `world` ranks: rank `r` owns the contiguous range
/// `r * block .. (r + 1) * block` (cut at `len`), `block = ceil(len / world)`. Every rank's
/// share is within `world - 1` values of equal, whatever the bucket size, and every rank
/// computes the same split from the same `len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shards {
    pub len: usize,
    pub world: usize,
}

impl Shards {
    pub fn new(len: usize, world: usize) -> Self {
        Shards {
            len,
            world: world.max(1),
        }
    }

    /// The values each rank's block holds (the last ranks' blocks end early at `len`).
    pub fn block(&self) -> usize {
        self.len.div_ceil(self.world)
    }

    /// The values rank `rank` owns.
    pub fn range(&self, rank: usize) -> Range<usize> {
        let b = self.block();
        (rank * b).min(self.len)..((rank + 1) * b).min(self.len)
    }

    /// The parts of every rank's block that one call each moves, as offsets into a block:
    /// a bucket of `bucket_values` carries a `1 / world` part for each rank.
    fn parts(&self, bucket_values: usize) -> impl Iterator<Item = Range<usize>> + use<> {
        let b = self.block();
        let piece = (bucket_values / self.world).clamp(1, b.max(1));
        (0..b).step_by(piece).map(move |at| at..(at + piece).min(b))
    }
}

/// JoinedPieces of one vector, read and written as the vector they make end to end.
pub struct JoinedPieces<'a> {
    pieces: &'a mut [Vec<f32>],
    /// Where each piece starts in the vector.
    starts: Vec<usize>,
}

impl<'a> JoinedPieces<'a> {
    pub fn new(pieces: &'a mut [Vec<f32>]) -> Self {
        let starts = pieces
            .iter()
            .scan(0, |at, p| {
                let s = *at;
                *at += p.len();
                Some(s)
            })
            .collect();
        JoinedPieces { pieces, starts }
    }

    pub fn len(&self) -> usize {
        self.starts
            .last()
            .map_or(0, |s| s + self.pieces[self.starts.len() - 1].len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The piece holding value `at`, and `at`'s place in it.
    fn locate(&self, at: usize) -> (usize, usize) {
        let i = self.starts.partition_point(|&s| s <= at).saturating_sub(1);
        (i, at - self.starts[i])
    }

    /// Copies values `from .. from + out.len()` into `out`; zeros past the end.
    pub fn read(&self, from: usize, out: &mut [f32]) {
        let end = (from + out.len()).min(self.len());
        out[end.saturating_sub(from)..].fill(0.0);
        let mut at = from;
        while at < end {
            let (i, off) = self.locate(at);
            let n = (self.pieces[i].len() - off).min(end - at);
            out[at - from..at - from + n].copy_from_slice(&self.pieces[i][off..off + n]);
            at += n;
        }
    }

    /// Writes `values` at `from ..`; what would fall past the end is dropped.
    pub fn write(&mut self, from: usize, values: &[f32]) {
        let end = (from + values.len()).min(self.len());
        let mut at = from;
        while at < end {
            let (i, off) = self.locate(at);
            let n = (self.pieces[i].len() - off).min(end - at);
            self.pieces[i][off..off + n].copy_from_slice(&values[at - from..at - from + n]);
            at += n;
        }
    }
}

/// Sums the vector `v` over the ranks and returns this rank's range of the sum
/// ([`Shards::range`]), moving at most `bucket_values` values per call: each call carries
/// the next part of every rank's block. Half the bytes of an all-reduce.
pub fn reduce_scatter(
    c: &mut dyn Collective,
    what: &str,
    v: &JoinedPieces<'_>,
    dtype: ReduceDtype,
    bucket_values: usize,
) -> Vec<f32> {
    let shards = Shards::new(v.len(), c.world());
    let b = shards.block();
    let mut out = Vec::with_capacity(b);
    let mut send = Vec::new();
    for part in shards.parts(bucket_values) {
        let n = part.len();
        send.resize(n * shards.world, 0.0);
        for r in 0..shards.world {
            v.read(r * b + part.start, &mut send[r * n..(r + 1) * n]);
        }
        out.extend(c.reduce_scatter_sum(what, &send, dtype));
    }
    out.truncate(shards.range(c.rank()).len());
    out
}

/// Every rank's range of `v` from that rank, in place: on entry this rank's range holds
/// its values, on return every range holds its owner's. At most `bucket_values` values a
/// call.
pub fn all_gather(
    c: &mut dyn Collective,
    what: &str,
    v: &mut JoinedPieces<'_>,
    bucket_values: usize,
) {
    let shards = Shards::new(v.len(), c.world());
    let (b, me) = (shards.block(), c.rank());
    let mut buf = Vec::new();
    for part in shards.parts(bucket_values) {
        let n = part.len();
        buf.resize(n * shards.world, 0.0);
        v.read(me * b + part.start, &mut buf[me * n..(me + 1) * n]);
        c.all_gather_blocks(what, &mut buf);
        for r in (0..shards.world).filter(|&r| r != me) {
            let from = r * b + part.start;
            let keep = shards.range(r).end.saturating_sub(from).min(n);
            v.write(from, &buf[r * n..r * n + keep]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_the_vector_once_and_nearly_equally() {
        for (len, world) in [(10, 3), (9, 3), (2, 3), (0, 2), (7, 1)] {
            let s = Shards::new(len, world);
            let ranges: Vec<Range<usize>> = (0..world).map(|r| s.range(r)).collect();
            assert_eq!(ranges.first().map(|r| r.start), Some(0));
            assert_eq!(ranges.last().map(|r| r.end), Some(len));
            for w in ranges.windows(2) {
                assert_eq!(w[0].end, w[1].start);
            }
            let most = ranges.iter().map(|r| r.len()).max().unwrap_or(0);
            let full = ranges.iter().filter(|r| r.len() == most).count();
            assert!(
                full >= 1 && most <= len.div_ceil(world),
                "{len} {world} {ranges:?}"
            );
        }
        assert_eq!(Shards::new(10, 3).range(2), 8..10);
        assert_eq!(Shards::new(2, 3).range(2), 2..2);
    }

    #[test]
    fn pieces_read_and_write_across_their_boundaries() {
        let mut raw = vec![vec![1.0, 2.0], vec![], vec![3.0, 4.0, 5.0]];
        let mut p = JoinedPieces::new(&mut raw);
        assert_eq!(p.len(), 5);
        let mut out = [0f32; 4];
        p.read(1, &mut out);
        assert_eq!(out, [2.0, 3.0, 4.0, 5.0]);
        p.read(3, &mut out);
        assert_eq!(out, [4.0, 5.0, 0.0, 0.0], "zeros past the end");
        p.write(1, &[9.0, 8.0, 7.0, 6.0, 5.0]);
        assert_eq!(raw, vec![vec![1.0, 9.0], vec![], vec![8.0, 7.0, 6.0]]);
    }

    #[test]
    fn alone_the_collectives_hand_back_the_vector() {
        let mut c = crate::collective::Solo::default();
        let mut raw = vec![vec![1.0, 2.0, 3.0], vec![4.0]];
        let mut p = JoinedPieces::new(&mut raw);
        // Buckets of one value: four calls.
        assert_eq!(
            reduce_scatter(&mut c, "t", &p, ReduceDtype::F32, 1),
            vec![1.0, 2.0, 3.0, 4.0]
        );
        all_gather(&mut c, "t", &mut p, 2);
        assert_eq!(raw, vec![vec![1.0, 2.0, 3.0], vec![4.0]]);
    }
}
