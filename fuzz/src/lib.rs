//! What roccl's fuzz targets share: a reader of the fuzzer's bytes (every target's input is
//! a plain byte layout, so that `examples/make_corpus.rs` can write meaningful seeds).

/// Reads fields from the front of the input; past its end every field reads as zero.
pub struct Reader<'a> {
    data: &'a [u8],
}

impl<'a> Reader<'a> {
    /// A reader of `data`.
    pub fn new(data: &'a [u8]) -> Reader<'a> {
        Reader { data }
    }

    /// Whether every byte has been read.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The next `n` bytes (fewer at the end).
    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let n = n.min(self.data.len());
        let (a, b) = self.data.split_at(n);
        self.data = b;
        a
    }

    /// A byte.
    pub fn u8(&mut self) -> u8 {
        self.bytes(1).first().copied().unwrap_or(0)
    }

    /// A flag (the low bit of a byte).
    pub fn bool(&mut self) -> bool {
        self.u8() & 1 != 0
    }

    /// A little-endian u16.
    pub fn u16(&mut self) -> u16 {
        let mut b = [0u8; 2];
        let s = self.bytes(2);
        b[..s.len()].copy_from_slice(s);
        u16::from_le_bytes(b)
    }

    /// A little-endian u32.
    pub fn u32(&mut self) -> u32 {
        let mut b = [0u8; 4];
        let s = self.bytes(4);
        b[..s.len()].copy_from_slice(s);
        u32::from_le_bytes(b)
    }

    /// A little-endian u64.
    pub fn u64(&mut self) -> u64 {
        let mut b = [0u8; 8];
        let s = self.bytes(8);
        b[..s.len()].copy_from_slice(s);
        u64::from_le_bytes(b)
    }

    /// A little-endian i32.
    pub fn i32(&mut self) -> i32 {
        self.u32() as i32
    }

    /// Bytes preceded by their u16 length.
    pub fn chunk(&mut self) -> &'a [u8] {
        let n = usize::from(self.u16());
        self.bytes(n)
    }

    /// Everything left.
    pub fn rest(&mut self) -> &'a [u8] {
        self.bytes(usize::MAX)
    }
}

/// Writes what [`Reader`] reads (for seeds).
#[derive(Default)]
pub struct Writer(pub Vec<u8>);

impl Writer {
    /// A byte.
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    /// A little-endian u16.
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// A little-endian u32.
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// A little-endian u64.
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// Bytes as they are.
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }
    /// Bytes preceded by their u16 length.
    pub fn chunk(&mut self, b: &[u8]) -> &mut Self {
        self.u16(b.len() as u16).bytes(b)
    }
}
