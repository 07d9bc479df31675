//! Reading the benchmarks' results back: markdown tables (by their column names) and
//! CSV files, and the numbers in their cells ("1.27x", "35216 (0.928)", "**8000**").

/// A table: its header and rows of cells, trimmed.
#[derive(Clone, Debug, PartialEq)]
pub struct Table {
    pub header: Vec<String>,
    pub rows: Vec<Vec<String>>,
}

impl Table {
    pub fn col(&self, name: &str) -> Result<usize, String> {
        self.header
            .iter()
            .position(|h| h == name)
            .ok_or_else(|| format!("no column {name:?} in {:?}", self.header))
    }

    /// One cell of every row, by column name.
    pub fn column(&self, name: &str) -> Result<Vec<&str>, String> {
        let i = self.col(name)?;
        Ok(self
            .rows
            .iter()
            .map(|r| r.get(i).map_or("", String::as_str))
            .collect())
    }
}

fn cells(line: &str) -> Vec<String> {
    let inner = line.trim().trim_start_matches('|').trim_end_matches('|');
    inner.split('|').map(|c| c.trim().to_string()).collect()
}

/// Every markdown table in `text`, in order.
pub fn markdown_tables(text: &str) -> Vec<Table> {
    let mut out = Vec::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let is_sep = |l: &str| {
            l.trim().starts_with('|') && l.chars().all(|c| matches!(c, '|' | '-' | ':' | ' '))
        };
        if !line.trim().starts_with('|') || !lines.peek().is_some_and(|l| is_sep(l)) {
            continue;
        }
        lines.next();
        let mut rows = Vec::new();
        while let Some(l) = lines.peek() {
            if !l.trim().starts_with('|') {
                break;
            }
            rows.push(cells(l));
            lines.next();
        }
        out.push(Table {
            header: cells(line),
            rows,
        });
    }
    out
}

/// The first markdown table in `text` that has every one of `columns`.
pub fn find_table(text: &str, columns: &[&str]) -> Result<Table, String> {
    markdown_tables(text)
        .into_iter()
        .find(|t| columns.iter().all(|c| t.header.iter().any(|h| h == c)))
        .ok_or_else(|| format!("no table with the columns {columns:?}"))
}

/// A CSV file without quoting (the benchmarks write none).
pub fn csv(text: &str) -> Result<Table, String> {
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let header = lines
        .next()
        .ok_or("empty CSV")?
        .split(',')
        .map(|c| c.trim().to_string())
        .collect::<Vec<_>>();
    let rows = lines
        .map(|l| {
            l.split(',')
                .map(|c| c.trim().to_string())
                .collect::<Vec<_>>()
        })
        .collect::<Vec<_>>();
    if let Some(r) = rows.iter().find(|r| r.len() != header.len()) {
        return Err(format!("CSV row {r:?} has not {} cells", header.len()));
    }
    Ok(Table { header, rows })
}

/// The leading number of a cell: "1.27x" -> 1.27, "35216 (0.928)" -> 35216,
/// "**8000**" -> 8000, "+5.1%" -> 5.1.
pub fn number(cell: &str) -> Result<f64, String> {
    let s = cell.trim().trim_matches('*').trim_start_matches('+');
    let end = s
        .char_indices()
        .find(|&(i, c)| !(c.is_ascii_digit() || c == '.' || (c == '-' && i == 0)))
        .map_or(s.len(), |(i, _)| i);
    s[..end]
        .parse()
        .map_err(|_| format!("no number in the cell {cell:?}"))
}

/// The number in parentheses in a cell: "35216 (0.928)" -> 0.928.
pub fn in_parens(cell: &str) -> Result<f64, String> {
    let inner = cell
        .split_once('(')
        .and_then(|(_, r)| r.split_once(')'))
        .map(|(n, _)| n)
        .ok_or_else(|| format!("no (number) in the cell {cell:?}"))?;
    number(inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_read_as_numbers() {
        assert_eq!(number("1.27x").unwrap(), 1.27);
        assert_eq!(number("**8000**").unwrap(), 8000.0);
        assert_eq!(number("+5.1%").unwrap(), 5.1);
        assert_eq!(number("-7%").unwrap(), -7.0);
        assert_eq!(number("35216 (0.928)").unwrap(), 35216.0);
        assert_eq!(in_parens("35216 (0.928)").unwrap(), 0.928);
        assert!(number("none").is_err());
        assert!(in_parens("12").is_err());
    }

    #[test]
    fn tables_are_found_by_their_columns() {
        let md = "intro\n\n| a | b |\n|---|---:|\n| 1 | 2x |\n| 3 | 4x |\n\ntext\n\n| c | d |\n|---|---|\n| x | y |\n";
        assert_eq!(markdown_tables(md).len(), 2);
        let t = find_table(md, &["c"]).unwrap();
        assert_eq!(t.rows, vec![vec!["x".to_string(), "y".to_string()]]);
        let t = find_table(md, &["a", "b"]).unwrap();
        assert_eq!(t.column("b").unwrap(), vec!["2x", "4x"]);
        assert!(find_table(md, &["a", "d"]).is_err());
    }

    #[test]
    fn csv_rows_must_match_the_header() {
        let t = csv("a,b\n1,2\n3,4\n").unwrap();
        assert_eq!(t.column("b").unwrap(), vec!["2", "4"]);
        assert!(csv("a,b\n1\n").is_err());
    }
}
