//! Verifiers: how a completion is compared with a reference answer.

/// A named comparison of a completion with an answer, giving a reward in [0, 1].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verifier {
    /// 1 if the trimmed completion equals the trimmed answer.
    Exact,
    /// 1 if both parse as numbers within 1e-6 (relative), else 0.
    Numeric,
    /// 1 if the completion contains the answer.
    Contains,
    /// Fraction of positions where the completion matches the answer, over the longer of the
    /// two: partial credit.
    Positional,
    /// The final answer of a worked solution, as GSM8K and MATH users extract it (the text
    /// after the last `####`, else the last `\boxed{...}`, else the last number), compared
    /// numerically (commas, signs, decimals, `a/b` and `\frac{a}{b}`), or as text when
    /// either side is not a number.
    Math,
}

impl Verifier {
    pub const ALL: [Verifier; 5] = [
        Verifier::Exact,
        Verifier::Numeric,
        Verifier::Contains,
        Verifier::Positional,
        Verifier::Math,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Verifier::Exact => "exact",
            Verifier::Numeric => "numeric",
            Verifier::Contains => "contains",
            Verifier::Positional => "positional",
            Verifier::Math => "math",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|v| v.name() == name)
    }

    pub fn score(self, completion: &str, answer: &str) -> f32 {
        let (c, a) = (completion.trim(), answer.trim());
        match self {
            Verifier::Exact => f32::from(u8::from(c == a)),
            Verifier::Numeric => match (c.parse::<f64>(), a.parse::<f64>()) {
                (Ok(x), Ok(y)) => f32::from(u8::from(same_number(x, y))),
                _ => 0.0,
            },
            Verifier::Contains => f32::from(u8::from(!a.is_empty() && c.contains(a))),
            Verifier::Positional => {
                let (cc, ac): (Vec<char>, Vec<char>) = (c.chars().collect(), a.chars().collect());
                let longest = cc.len().max(ac.len());
                if longest == 0 {
                    return 1.0;
                }
                let same = cc.iter().zip(&ac).filter(|(x, y)| x == y).count();
                same as f32 / longest as f32
            }
            Verifier::Math => f32::from(u8::from(math_equal(c, a))),
        }
    }
}

/// Equal within 1e-6, relative to the reference `y` (absolute below 1).
fn same_number(x: f64, y: f64) -> bool {
    (x - y).abs() <= 1e-6 * y.abs().max(1.0)
}

/// Whether a solution's final answer equals the reference's (see [`Verifier::Math`]).
fn math_equal(completion: &str, answer: &str) -> bool {
    // The reference is its own answer unless it is a worked solution with a marker.
    let want = marked_answer(answer).unwrap_or_else(|| answer.trim().to_string());
    let Some(got) = final_answer(completion) else {
        return false;
    };
    match (number(&got), number(&want)) {
        (Some(x), Some(y)) => same_number(x, y),
        _ => normalise(&got) == normalise(&want),
    }
}

/// The final answer of a worked solution: after the last `####`, else inside the last
/// `\boxed{...}` (braces nested), else the last number; a bare answer is its own.
fn final_answer(text: &str) -> Option<String> {
    if let Some(a) = marked_answer(text) {
        return Some(a);
    }
    if number(text).is_some() {
        return Some(text.trim().to_string());
    }
    last_number(text).or_else(|| (!text.trim().is_empty()).then(|| text.trim().to_string()))
}

/// The answer after the last `####`, else inside the last `\\boxed{...}`.
fn marked_answer(text: &str) -> Option<String> {
    if let Some(i) = text.rfind("####") {
        let rest = text[i + 4..].trim();
        return Some(rest.lines().next().unwrap_or("").trim().to_string());
    }
    let i = text.rfind("\\boxed")?;
    braced(&text[i + "\\boxed".len()..]).map(|inner| inner.trim().to_string())
}

/// The contents of the `{...}` that `s` starts with (after spaces), braces nested.
fn braced(s: &str) -> Option<&str> {
    let s = s.trim_start();
    let body = s.strip_prefix('{')?;
    let mut depth = 1;
    for (i, c) in body.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(&body[..i]);
                }
            }
            _ => {}
        }
    }
    None
}

/// The last number written in `text` (`-1,234.5`, `3/4`), as written.
fn last_number(text: &str) -> Option<String> {
    let chars: Vec<char> = text.chars().collect();
    let mut end = chars.len();
    while end > 0 {
        if chars[end - 1].is_ascii_digit() {
            let mut start = end;
            while start > 0 {
                let c = chars[start - 1];
                let inside = c.is_ascii_digit()
                    || ((c == ',' || c == '.' || c == '/')
                        && start >= 2
                        && chars[start - 2].is_ascii_digit());
                if !inside {
                    break;
                }
                start -= 1;
            }
            if start > 0 && chars[start - 1] == '-' {
                start -= 1;
            }
            return Some(chars[start..end].iter().collect());
        }
        end -= 1;
    }
    None
}

/// `s` as a number: commas between digit groups, a leading `$` or trailing `%` / `.`,
/// `a/b`, `\frac{a}{b}` (and `\dfrac`, `\tfrac`), surrounding `$...$` math marks.
fn number(s: &str) -> Option<f64> {
    let mut t = s.trim().trim_matches('$').trim().to_string();
    for unit in ["\\%", "%", "\\$"] {
        t = t.replace(unit, "");
    }
    let t = t.trim().trim_end_matches('.').trim();
    let t = t.strip_prefix('$').unwrap_or(t).trim();
    let (negative, unsigned) = match t.strip_prefix('-') {
        Some(rest) => (true, rest.trim_start()),
        None => (false, t),
    };
    for frac in ["\\frac", "\\dfrac", "\\tfrac"] {
        if let Some(rest) = unsigned.strip_prefix(frac) {
            let num = braced(rest)?;
            let after = &rest.trim_start()[num.len() + 2..];
            let v = number(num)? / number(braced(after)?)?;
            return v.is_finite().then_some(if negative { -v } else { v });
        }
    }
    if let Some((a, b)) = t.split_once('/') {
        let v = plain(a)? / plain(b)?;
        return v.is_finite().then_some(v);
    }
    plain(t)
}

/// A decimal number, commas allowed only between groups of three digits.
fn plain(s: &str) -> Option<f64> {
    let s = s.trim();
    let (sign, digits) = match s.strip_prefix('-') {
        Some(rest) => (-1.0, rest.trim()),
        None => (1.0, s.strip_prefix('+').unwrap_or(s)),
    };
    let (int, frac) = digits.split_once('.').unwrap_or((digits, ""));
    let groups: Vec<&str> = int.split(',').collect();
    let grouped = groups.len() == 1
        || (!groups[0].is_empty()
            && groups[0].len() <= 3
            && groups[1..].iter().all(|g| g.len() == 3));
    if !grouped
        || int.is_empty() && frac.is_empty()
        || !int.chars().all(|c| c.is_ascii_digit() || c == ',')
        || !frac.chars().all(|c| c.is_ascii_digit())
    {
        return None;
    }
    // Rust reads `5.` and `.5` as numbers.
    format!("{}.{}", int.replace(',', ""), frac)
        .parse::<f64>()
        .ok()
        .map(|v| sign * v)
}

/// Text answers compare without spaces, `\text{}`, `\left`/`\right` and case.
fn normalise(s: &str) -> String {
    let mut t = s.to_string();
    for mark in ["\\text", "\\left", "\\right", "\\!", "\\,", "$"] {
        t = t.replace(mark, "");
    }
    t.chars()
        .filter(|c| !c.is_whitespace() && *c != '{' && *c != '}')
        .flat_map(char::to_lowercase)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verifiers_score_as_documented() {
        assert_eq!(Verifier::Exact.score(" 42 ", "42"), 1.0);
        assert_eq!(Verifier::Exact.score("420", "42"), 0.0);
        assert_eq!(Verifier::Numeric.score("42.0", "42"), 1.0);
        assert_eq!(Verifier::Numeric.score("x", "42"), 0.0);
        assert_eq!(Verifier::Contains.score("it is 42.", "42"), 1.0);
        assert_eq!(Verifier::Positional.score("1239", "1234"), 0.75);
        assert_eq!(Verifier::Positional.score("12", "1234"), 0.5);
        assert_eq!(Verifier::from_name("numeric"), Some(Verifier::Numeric));
        assert_eq!(Verifier::from_name("math"), Some(Verifier::Math));
    }

    #[test]
    fn the_math_verifier_finds_the_final_answer_as_gsm8k_and_math_users_do() {
        let m = |c: &str, a: &str| Verifier::Math.score(c, a);
        // GSM8K: the text after the last ####, on both sides.
        assert_eq!(m("She pays 3 * 14 = 42.\n#### 42", "#### 42"), 1.0);
        assert_eq!(m("#### 41\n#### 42", "42"), 1.0);
        assert_eq!(m("#### 43", "work... #### 42"), 0.0);
        // Commas, signs, currency, percent, trailing period, decimals.
        assert_eq!(m("The total is $1,234.", "1234"), 1.0);
        assert_eq!(m("#### -7", "-7.0"), 1.0);
        assert_eq!(m("#### 7", "-7"), 0.0);
        assert_eq!(m("#### 50%", "50"), 1.0);
        assert_eq!(m("#### 0.5", ".5"), 1.0);
        assert_eq!(
            m("#### 12,34", "1234"),
            0.0,
            "12,34 is not a grouped number"
        );
        // MATH: the last \boxed, braces nested; fractions in both notations.
        assert_eq!(m("so \\boxed{\\frac{3}{4}}", "0.75"), 1.0);
        assert_eq!(m("\\boxed{1} then \\boxed{3/4}", "\\frac{3}{4}"), 1.0);
        assert_eq!(
            m("\\boxed{1} then \\boxed{3/4}", "1"),
            0.0,
            "the last box counts"
        );
        assert_eq!(m("\\boxed{-\\dfrac{1}{2}}", "-0.5"), 1.0);
        assert_eq!(m("\\boxed{\\text{Tuesday}}", "tuesday"), 1.0);
        assert_eq!(m("\\boxed{x^{2}+1}", "x^2+1"), 1.0);
        // No marker: the last number written.
        assert_eq!(m("First 12 apples, then 30 more: 42 apples", "42"), 1.0);
        assert_eq!(m("I think it is 41 or so", "42"), 0.0);
        assert_eq!(m("no number here", "42"), 0.0);
        assert_eq!(m("", "42"), 0.0);
        assert_eq!(m("1/0", "1"), 0.0);
    }

    proptest::proptest! {
        /// Any text, unicode and unbalanced braces included, scores in [0, 1] without a panic.
        #[test]
        fn the_math_verifier_takes_any_text(
            c in "(\\\\boxed|\\\\frac|[{}#$,./ -]|[0-9]|\\PC){0,24}",
            a in "(\\\\boxed|[{}#$,./ -]|[0-9]|\\PC){0,12}",
        ) {
            let r = Verifier::Math.score(&c, &a);
            proptest::prop_assert!((0.0..=1.0).contains(&r));
        }
    }
}
