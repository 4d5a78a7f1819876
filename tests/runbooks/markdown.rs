//! The ```sh blocks of one section of a markdown file, in order, each with the step (the
//! top-level ordered-list item) it belongs to and the prose before it. Pure: the caller reads
//! the file.

/// One fenced ```sh block.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Block {
    /// The number of the ordered-list item it is in (`3` for `3. Import ...`); `None` before
    /// the list or after it.
    pub step: Option<u32>,
    /// The text before it: its list item's, or the section's since the previous block.
    pub prose: String,
    /// The code, without the fence's indentation.
    pub code: String,
}

/// A heading's level and text, if `line` is one (`### Runbook A` is `(3, "Runbook A")`).
fn heading(line: &str) -> Option<(usize, &str)> {
    let level = line.bytes().take_while(|b| *b == b'#').count();
    let rest = &line[level..];
    (level > 0 && rest.starts_with(' ')).then(|| (level, rest.trim()))
}

/// The opening fence's indentation and info string, if `line` opens or closes a fence.
fn fence(line: &str) -> Option<(usize, &str)> {
    let indent = line.len() - line.trim_start_matches(' ').len();
    let rest = line[indent..].strip_prefix("```")?;
    Some((indent, rest.trim()))
}

/// The number of a top-level ordered-list item (`12. text`), and its text.
fn list_item(line: &str) -> Option<(u32, &str)> {
    let digits = line.bytes().take_while(u8::is_ascii_digit).count();
    let rest = line[digits..].strip_prefix(". ")?;
    Some((line[..digits].parse().ok()?, rest))
}

/// The lines of the section under the one heading whose text starts with `title`, up to the
/// next heading of the same or a higher level (lines inside fences are never headings).
pub(crate) fn section<'a>(markdown: &'a str, title: &str) -> Result<Vec<&'a str>, String> {
    let mut found: Option<(usize, Vec<&str>)> = None;
    let mut done = false;
    let mut count = 0;
    let mut in_fence = false;
    for line in markdown.lines() {
        let h = if in_fence { None } else { heading(line) };
        if fence(line).is_some() {
            in_fence = !in_fence;
        }
        match (h, found.as_mut()) {
            (Some((_, text)), _) if text.starts_with(title) => {
                count += 1;
                found = Some((heading(line).map_or(0, |h| h.0), Vec::new()));
                done = false;
            }
            (Some((level, _)), Some((own, _))) if level <= *own => done = true,
            (_, Some((_, lines))) if !done => lines.push(line),
            _ => {}
        }
    }
    match (count, found) {
        (1, Some((_, lines))) => Ok(lines),
        (0, _) => Err(format!("no heading starting with '{title}'")),
        (n, _) => Err(format!(
            "{n} headings start with '{title}'; one was expected"
        )),
    }
}

/// The ```sh blocks under the heading starting with `title`, in order.
pub(crate) fn sh_blocks(markdown: &str, title: &str) -> Result<Vec<Block>, String> {
    let mut blocks = Vec::new();
    let mut step = None;
    let mut prose = String::new();
    // (indentation, is sh, lines) of the fence being read
    let mut open: Option<(usize, bool, Vec<&str>)> = None;
    for line in section(markdown, title)? {
        if let Some((indent, sh, lines)) = open.as_mut() {
            if fence(line).is_some_and(|(_, info)| info.is_empty()) {
                if *sh {
                    let code = lines.join("\n") + "\n";
                    blocks.push(Block {
                        step,
                        prose: std::mem::take(&mut prose).trim().to_string(),
                        code,
                    });
                }
                open = None;
            } else {
                let strip = line.len() - line.trim_start_matches(' ').len();
                lines.push(&line[strip.min(*indent)..]);
            }
            continue;
        }
        if let Some((indent, info)) = fence(line) {
            open = Some((indent, info == "sh", Vec::new()));
        } else if let Some((n, text)) = list_item(line) {
            step = Some(n);
            prose = text.to_string();
        } else {
            if !line.is_empty() && !line.starts_with(' ') && step.is_some() {
                // a paragraph after the list ends it
                step = None;
                prose.clear();
            }
            prose.push('\n');
            prose.push_str(line.trim());
        }
    }
    if open.is_some() {
        return Err(format!("a fence under '{title}' is not closed"));
    }
    Ok(blocks)
}

/// The one block of `step`, or why there is not exactly one.
pub(crate) fn step(blocks: &[Block], n: u32) -> Result<&Block, String> {
    let of: Vec<&Block> = blocks.iter().filter(|b| b.step == Some(n)).collect();
    match of.as_slice() {
        [one] => Ok(one),
        _ => Err(format!(
            "step {n} has {} ```sh blocks; one was expected",
            of.len()
        )),
    }
}

/// The inline code spans (`...`) of `text`.
pub(crate) fn code_spans(text: &str) -> Vec<&str> {
    text.split('`').skip(1).step_by(2).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOC: &str = "# Title\n\n## Runbook A: in place\n\nIntro `X` here:\n```sh\nNODE=${NODE:-n1}\n```\n\n\
0. First, as the admin.\n   ```sh\n   declare\n     --indented\n   ```\n\
1. Then python, which is skipped:\n   ```python\n   # not a heading\n   ```\n   and more\n   ```sh\n   run &\n   PID=$!\n   ```\n\
2. Must end with `would move 0; ...; holds 0`:\n   ```sh\n   check\n   ```\n\nAfter the list.\n```sh\nlast\n```\n\
### A subsection\n```sh\nsub\n```\n## Runbook B\n```sh\nother\n```\n";

    #[test]
    fn blocks_come_with_their_step_and_prose_and_lose_the_fence_indentation() {
        let b = sh_blocks(DOC, "Runbook A").unwrap();
        let got: Vec<(Option<u32>, &str)> = b.iter().map(|b| (b.step, b.code.as_str())).collect();
        assert_eq!(
            got,
            vec![
                (None, "NODE=${NODE:-n1}\n"),
                (Some(0), "declare\n  --indented\n"),
                (Some(1), "run &\nPID=$!\n"),
                (Some(2), "check\n"),
                (None, "last\n"),
                (None, "sub\n"),
            ]
        );
        assert_eq!(b[0].prose, "Intro `X` here:");
        assert!(b[2].prose.starts_with("Then python") && b[2].prose.ends_with("and more"));
        assert_eq!(code_spans(&b[3].prose), vec!["would move 0; ...; holds 0"]);
        assert_eq!(step(&b, 1).unwrap().code, "run &\nPID=$!\n");
        assert!(step(&b, 7).unwrap_err().contains("step 7 has 0"));
    }

    #[test]
    fn a_section_ends_at_a_heading_of_its_level_and_must_be_one() {
        assert_eq!(sh_blocks(DOC, "Runbook B").unwrap()[0].code, "other\n");
        assert!(
            sh_blocks(DOC, "Runbook C")
                .unwrap_err()
                .contains("no heading")
        );
        assert!(
            sh_blocks(DOC, "Runbook")
                .unwrap_err()
                .contains("2 headings")
        );
        let open = "## S\n```sh\nx\n";
        assert!(sh_blocks(open, "S").unwrap_err().contains("not closed"));
    }

    #[test]
    fn the_documents_name_what_the_test_runs() {
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
        let migrating = std::fs::read_to_string(format!("{root}/docs/MIGRATING.md")).unwrap();
        for title in ["Runbook A:", "Runbook B:"] {
            let b = sh_blocks(&migrating, title).unwrap();
            for n in 0..=3 {
                step(&b, n).unwrap_or_else(|e| panic!("{title} {e}"));
            }
        }
        let readme = std::fs::read_to_string(format!("{root}/README.md")).unwrap();
        let quick = sh_blocks(&readme, "Quick start").unwrap();
        assert!(quick.iter().any(|b| b.prose.contains("By hand")));
    }
}
