//! Aligned text tables for the CLI's listings: each column as wide as its widest cell, numbers
//! right-aligned, no trailing spaces (so the last column can be read with `ends_with`).

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
        let all: Vec<&Vec<String>> = std::iter::once(&header).chain(&self.rows).collect();
        let widths: Vec<usize> = (0..self.columns.len())
            .map(|i| all.iter().map(|r| r.get(i).map_or(0, |c| c.chars().count())).max().unwrap_or(0))
            .collect();
        all.iter()
            .map(|r| {
                let cells = self.columns.iter().zip(&widths).enumerate().map(|(i, ((_, align), w))| {
                    let cell = r.get(i).map_or("", String::as_str);
                    match align {
                        Align::Left => format!("{cell:<w$}"),
                        Align::Right => format!("{cell:>w$}"),
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
}
