//! Aligned text tables for the CLI's listings: each column as wide as its widest cell, numbers
//! right-aligned, no trailing spaces (so the last column can be read with `ends_with`). A cell
//! longer than `MAX_CELL` characters is cut, ending in `…`: a table is for reading, and the
//! listings' `--json` has every value whole.

/// The most characters a cell shows. A value of any length (a job type, a key, an error written by
/// hand) must neither stretch every line of a listing nor fail it: padding through `format!`'s
/// width made a cell over 65,535 characters panic, and with it every `dlq list`.
const MAX_CELL: usize = 200;

/// `cell` as shown: control characters written as escapes (`\x1B`, as psql shows them), then cut
/// to `MAX_CELL` characters. A key, a job type's name or an error is written by whoever enqueued
/// or failed the job: raw, an escape sequence in it recoloured or rewrote the operator's terminal,
/// and a newline broke the table (review helper-119 F3). Also what an error quotes of an input
/// that may be long (a job's arguments, up to 4 MiB read).
pub fn shown(cell: &str) -> std::borrow::Cow<'_, str> {
    let cell = escaped(cell);
    match cell.char_indices().nth(MAX_CELL) {
        None => cell,
        Some(_) => {
            let cut = cell.char_indices().nth(MAX_CELL - 1).map_or(cell.len(), |(i, _)| i);
            format!("{}…", &cell[..cut]).into()
        }
    }
}

/// `text` with its control characters, and the marks that reorder text on a terminal (U+200E,
/// U+200F, U+202A to U+202E, U+2066 to U+2069), written as escapes (`\x1B`, `\u202E`), whole:
/// what the CLI prints of a value someone else wrote (a key, an error, a session's query).
pub fn escaped(text: &str) -> std::borrow::Cow<'_, str> {
    use std::fmt::Write;
    let hidden = |c: char| {
        c.is_control() || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
    };
    if !text.chars().any(hidden) {
        return text.into();
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match u32::from(c) {
            _ if !hidden(c) => out.push(c),
            code @ ..=0xFF => write!(out, "\\x{code:02X}").unwrap_or_default(),
            code => write!(out, "\\u{code:04X}").unwrap_or_default(),
        }
    }
    out.into()
}

/// How a column's cells line up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Align {
    Left,
    Right,
}

/// A table printed all at once, after every row is known.
#[derive(Debug)]
pub struct Table {
    columns: Vec<(&'static str, Align)>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(columns: &[(&'static str, Align)]) -> Self {
        Self { columns: columns.to_vec(), rows: Vec::new() }
    }

    /// Adds a row; cells beyond the columns are ignored, missing ones are blank.
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// The table's lines, header first.
    pub fn lines(&self) -> Vec<String> {
        let header: Vec<String> = self.columns.iter().map(|(name, _)| name.to_string()).collect();
        let all: Vec<Vec<std::borrow::Cow<'_, str>>> = std::iter::once(&header)
            .chain(&self.rows)
            .map(|r| (0..self.columns.len()).map(|i| shown(r.get(i).map_or("", String::as_str))).collect())
            .collect();
        let widths: Vec<usize> =
            (0..self.columns.len()).map(|i| all.iter().map(|r| r[i].chars().count()).max().unwrap_or(0)).collect();
        all.iter()
            .map(|r| {
                let cells = self.columns.iter().zip(&widths).enumerate().map(|(i, ((_, align), w))| {
                    let cell = &r[i];
                    let padding = " ".repeat(w - cell.chars().count());
                    match align {
                        Align::Left => format!("{cell}{padding}"),
                        Align::Right => format!("{padding}{cell}"),
                    }
                });
                cells.collect::<Vec<_>>().join("  ").trim_end().to_string()
            })
            .collect()
    }

    pub fn print(&self) {
        for line in self.lines() {
            println!("{line}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_are_as_wide_as_their_widest_cell_and_lines_end_without_padding() {
        let mut t = Table::new(&[("QUEUE", Align::Left), ("READY", Align::Right), ("STATE", Align::Left)]);
        t.row(vec!["a_long_queue_name".into(), "7".into(), String::new()]);
        t.row(vec!["q".into(), "12345678".into(), "paused".into()]);
        assert_eq!(
            t.lines(),
            [
                "QUEUE                 READY  STATE",
                "a_long_queue_name         7",
                "q                  12345678  paused",
            ]
        );
    }

    /// Review (helper-77, #6): a dead letter whose type was 100,000 characters long made
    /// `format!`'s padding panic, and `dlq list` failed for every dead letter.
    #[test]
    fn a_cell_of_any_length_is_cut_and_never_fails_the_table() {
        let mut t = Table::new(&[("TYPE", Align::Left), ("N", Align::Right)]);
        t.row(vec!["x".repeat(100_000), "1".into()]);
        t.row(vec!["é".repeat(MAX_CELL), "2".into()]);
        let lines = t.lines();
        assert_eq!(lines[1], format!("{}…  1", "x".repeat(MAX_CELL - 1)));
        assert_eq!(lines[2], format!("{}  2", "é".repeat(MAX_CELL)), "a cell of exactly MAX_CELL is whole");
    }

    /// Review (helper-119, F3): a key a producer chose reached the operator's terminal raw: an
    /// escape sequence recoloured it, a newline broke the table.
    #[test]
    fn control_characters_are_shown_escaped() {
        let mut t = Table::new(&[("KEY", Align::Left), ("N", Align::Right)]);
        t.row(vec!["\u{1b}[31mred\tb\nc\u{7f}\u{85}é".into(), "1".into()]);
        t.row(vec![format!("{}\u{1b}", "x".repeat(MAX_CELL - 2)), "2".into()]);
        let lines = t.lines();
        assert_eq!(shown("\u{1b}[31mred\tb\nc\u{7f}\u{85}é"), "\\x1B[31mred\\x09b\\x0Ac\\x7F\\x85é");
        assert_eq!(lines[2], format!("{}\\…  2", "x".repeat(MAX_CELL - 2)), "escaped, then cut");
        assert!(lines.iter().all(|l| !l.chars().any(char::is_control)), "{lines:?}");
        assert_eq!(escaped("a\u{202e}b\u{2066}c"), "a\\u202Eb\\u2066c", "marks that reorder text");
        assert_eq!(escaped("C:\\data"), "C:\\data", "a backslash is shown as it is");
    }
}
