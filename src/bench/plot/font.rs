//! The bitmap font the plots write with: 5x7 glyphs for printable ASCII (0x20..=0x7e) in a 5x8
//! cell whose last row holds descenders. Embedded so that a plot needs no font files and no
//! system libraries.

/// Width of a glyph in pixels, before scaling.
pub(super) const GLYPH_WIDTH: usize = 5;
/// Height of a glyph cell in pixels (7 rows above the baseline, 1 below), before scaling.
pub(super) const GLYPH_HEIGHT: usize = 8;

const FIRST: u8 = 0x20;
const COUNT: usize = 95;
const PER_BLOCK: usize = 16;

/// The glyphs as they look. Rows of 16 glyphs in ASCII order, each glyph five pixels wide (`#` set,
/// `.` clear) and eight rows tall; spaces between glyphs are only for the eye. A line that does not
/// start with `#` or `.` labels the block below it and is skipped.
const SHEET: &str = r##"
0x20       !    "    #    $    %    &    '    (    )    *    +    ,    -    .    /
..... ..#.. .#.#. .#.#. ..#.. ##... .##.. ..#.. ...#. .#... ..... ..... ..... ..... ..... ....#
..... ..#.. .#.#. .#.#. .#### ##..# #..#. ..#.. ..#.. ..#.. ..#.. ..#.. ..... ..... ..... ....#
..... ..#.. .#.#. ##### #.#.. ...#. #.#.. .#... .#... ...#. #.#.# ..#.. ..... ..... ..... ...#.
..... ..#.. ..... .#.#. .###. ..#.. .#... ..... .#... ...#. .###. ##### ..... ##### ..... ..#..
..... ..#.. ..... ##### ..#.# .#... #.#.# ..... .#... ...#. #.#.# ..#.. ..... ..... ..... .#...
..... ..... ..... .#.#. ####. #..## #..#. ..... ..#.. ..#.. ..#.. ..#.. .##.. ..... .##.. #....
..... ..#.. ..... .#.#. ..#.. ...## .##.# ..... ...#. .#... ..... ..... ..#.. ..... .##.. #....
..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... .#... ..... ..... .....
0x30  0    1    2    3    4    5    6    7    8    9    :    ;    <    =    >    ?
.###. ..#.. .###. ##### ...#. ##### ..##. ##### .###. .###. ..... ..... ...#. ..... .#... .###.
#...# .##.. #...# ...#. ..##. #.... .#... ....# #...# #...# .##.. .##.. ..#.. ..... ..#.. #...#
#..## ..#.. ....# ..#.. .#.#. ####. #.... ...#. #...# #...# .##.. .##.. .#... ##### ...#. ....#
#.#.# ..#.. ...#. ...#. #..#. ....# ####. ..#.. .###. .#### ..... ..... #.... ..... ....# ...#.
##..# ..#.. ..#.. ....# ##### ....# #...# .#... #...# ....# .##.. .##.. .#... ##### ...#. ..#..
#...# ..#.. .#... #...# ...#. #...# #...# .#... #...# ...#. .##.. ..#.. ..#.. ..... ..#.. .....
.###. .###. ##### .###. ...#. .###. .###. .#... .###. .##.. ..... .#... ...#. ..... .#... ..#..
..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... .....
0x40  @    A    B    C    D    E    F    G    H    I    J    K    L    M    N    O
.###. .###. ####. .###. ###.. ##### ##### .###. #...# .###. ..### #...# #.... #...# #...# .###.
#...# #...# #...# #...# #..#. #.... #.... #...# #...# ..#.. ...#. #..#. #.... ##.## #...# #...#
....# #...# #...# #.... #...# #.... #.... #.... #...# ..#.. ...#. #.#.. #.... #.#.# ##..# #...#
.##.# ##### ####. #.... #...# ####. ####. #.### ##### ..#.. ...#. ##... #.... #.#.# #.#.# #...#
#.#.# #...# #...# #.... #...# #.... #.... #...# #...# ..#.. ...#. #.#.. #.... #...# #..## #...#
#.#.# #...# #...# #...# #..#. #.... #.... #...# #...# ..#.. #..#. #..#. #.... #...# #...# #...#
.###. #...# ####. .###. ###.. ##### #.... .#### #...# .###. .##.. #...# ##### #...# #...# .###.
..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... .....
0x50  P    Q    R    S    T    U    V    W    X    Y    Z    [    \    ]    ^    _
####. .###. ####. .#### ##### #...# #...# #...# #...# #...# ##### .###. #.... .###. ..#.. .....
#...# #...# #...# #.... ..#.. #...# #...# #...# #...# #...# ....# .#... #.... ...#. .#.#. .....
#...# #...# #...# #.... ..#.. #...# #...# #...# .#.#. #...# ...#. .#... .#... ...#. #...# .....
####. #...# ####. .###. ..#.. #...# #...# #.#.# ..#.. .#.#. ..#.. .#... ..#.. ...#. ..... .....
#.... #.#.# #.#.. ....# ..#.. #...# #...# #.#.# .#.#. ..#.. .#... .#... ...#. ...#. ..... .....
#.... #..#. #..#. ....# ..#.. #...# .#.#. #.#.# #...# ..#.. #.... .#... ....# ...#. ..... .....
#.... .##.# #...# ####. ..#.. .###. ..#.. .#.#. #...# ..#.. ##### .###. ....# .###. ..... .....
..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... ..... #####
0x60  `    a    b    c    d    e    f    g    h    i    j    k    l    m    n    o
.#... ..... #.... ..... ....# ..... ..##. ..... #.... ..#.. ...#. #.... .##.. ..... ..... .....
..#.. ..... #.... ..... ....# ..... .#..# ..... #.... ..... ..... #.... ..#.. ..... ..... .....
...#. .###. #.##. .###. .##.# .###. .#... .#### #.##. .##.. ..##. #..#. ..#.. ##.#. #.##. .###.
..... ....# ##..# #.... #..## #...# ###.. #...# ##..# ..#.. ...#. #.#.. ..#.. #.#.# ##..# #...#
..... .#### #...# #.... #...# ##### .#... #...# #...# ..#.. ...#. ##... ..#.. #.#.# #...# #...#
..... #...# #...# #...# #...# #.... .#... .#### #...# ..#.. ...#. #.#.. ..#.. #.#.# #...# #...#
..... .#### ####. .###. .#### .###. .#... ....# #...# .###. #..#. #..#. .###. #.#.# #...# .###.
..... ..... ..... ..... ..... ..... ..... .###. ..... ..... .##.. ..... ..... ..... ..... .....
0x70  p    q    r    s    t    u    v    w    x    y    z    {    |    }    ~
..... ..... ..... ..... .#... ..... ..... ..... ..... ..... ..... ...## ..#.. ##... .....
..... ..... ..... ..... .#... ..... ..... ..... ..... ..... ..... ..#.. ..#.. ..#.. .....
####. .#### #.##. .#### ###.. #...# #...# #...# #...# #...# ##### ..#.. ..#.. ..#.. .#...
#...# #...# ##..# #.... .#... #...# #...# #...# .#.#. #...# ...#. .#... ..#.. ...#. #.#.#
#...# #...# #.... .###. .#... #...# #...# #.#.# ..#.. #...# ..#.. ..#.. ..#.. ..#.. ...#.
####. .#### #.... ....# .#..# #..## .#.#. #.#.# .#.#. .#### .#... ..#.. ..#.. ..#.. .....
#.... ....# #.... ####. ..##. .##.# ..#.. .#.#. #...# ....# ##### ...## ..#.. ##... .....
#.... ....# ..... ..... ..... ..... ..... ..... ..... .###. ..... ..... ..... ..... .....
"##;

/// One row per byte, the leftmost pixel in bit 4.
type Glyph = [u8; GLYPH_HEIGHT];

/// The sheet decoded at compile time; a malformed sheet fails the build, not a plot.
const GLYPHS: [Glyph; COUNT] = decode(SHEET.as_bytes());

const fn decode(sheet: &[u8]) -> [Glyph; COUNT] {
    let mut glyphs = [[0u8; GLYPH_HEIGHT]; COUNT];
    let mut pixel_rows = 0;
    let mut i = 0;
    while i < sheet.len() {
        let mut end = i;
        while end < sheet.len() && sheet[end] != b'\n' {
            end += 1;
        }
        let mut first = i;
        while first < end && sheet[first] == b' ' {
            first += 1;
        }
        if first < end && (sheet[first] == b'#' || sheet[first] == b'.') {
            let block = pixel_rows / GLYPH_HEIGHT;
            let row = pixel_rows % GLYPH_HEIGHT;
            let mut pixel = 0;
            let mut j = first;
            while j < end {
                let b = sheet[j];
                if b == b'#' || b == b'.' {
                    let glyph = block * PER_BLOCK + pixel / GLYPH_WIDTH;
                    assert!(
                        glyph < COUNT,
                        "font sheet: more glyphs than printable ASCII"
                    );
                    if b == b'#' {
                        glyphs[glyph][row] |= 1 << (GLYPH_WIDTH - 1 - pixel % GLYPH_WIDTH);
                    }
                    pixel += 1;
                } else {
                    assert!(
                        b == b' ',
                        "font sheet: pixel rows hold only '#', '.' and spaces"
                    );
                }
                j += 1;
            }
            let expected = if block * PER_BLOCK + PER_BLOCK <= COUNT {
                PER_BLOCK
            } else {
                COUNT - block * PER_BLOCK
            };
            assert!(
                pixel == expected * GLYPH_WIDTH,
                "font sheet: a pixel row has the wrong width"
            );
            pixel_rows += 1;
        }
        i = end + 1;
    }
    assert!(
        pixel_rows == COUNT.div_ceil(PER_BLOCK) * GLYPH_HEIGHT,
        "font sheet: wrong number of pixel rows"
    );
    glyphs
}

/// The glyph for `c`; characters outside printable ASCII draw as `?`.
pub(super) fn glyph(c: char) -> &'static Glyph {
    let index = match u8::try_from(c) {
        Ok(b) if (FIRST..FIRST + COUNT as u8).contains(&b) => b - FIRST,
        _ => b'?' - FIRST,
    };
    &GLYPHS[usize::from(index)]
}

/// Whether pixel (`x`, `y`) of a glyph is set; `x` < [`GLYPH_WIDTH`], `y` < [`GLYPH_HEIGHT`].
pub(super) fn lit(glyph: &Glyph, x: usize, y: usize) -> bool {
    (glyph[y] >> (GLYPH_WIDTH - 1 - x)) & 1 == 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_printable_glyph_but_space_has_pixels() {
        for c in (0x21u8..=0x7e).map(char::from) {
            assert!(glyph(c).iter().any(|&row| row != 0), "{c:?} is blank");
        }
        assert!(glyph(' ').iter().all(|&row| row == 0));
    }

    #[test]
    fn glyphs_are_distinct() {
        for (a, first) in GLYPHS.iter().enumerate() {
            for (b, second) in GLYPHS.iter().enumerate().skip(a + 1) {
                assert_ne!(first, second, "glyphs {a} and {b} are identical");
            }
        }
    }

    #[test]
    fn sheet_reads_as_drawn() {
        // The digit one: a stem with a flag and a foot.
        assert_eq!(
            glyph('1'),
            &[0b00100, 0b01100, 0b00100, 0b00100, 0b00100, 0b00100, 0b01110, 0]
        );
        assert!(lit(glyph('_'), 0, GLYPH_HEIGHT - 1));
        assert_eq!(glyph('\u{e9}'), glyph('?'));
    }
}
