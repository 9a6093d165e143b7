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
}

impl Verifier {
    pub const ALL: [Verifier; 4] = [
        Verifier::Exact,
        Verifier::Numeric,
        Verifier::Contains,
        Verifier::Positional,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Verifier::Exact => "exact",
            Verifier::Numeric => "numeric",
            Verifier::Contains => "contains",
            Verifier::Positional => "positional",
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
                (Ok(x), Ok(y)) => f32::from(u8::from((x - y).abs() <= 1e-6 * y.abs().max(1.0))),
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
        }
    }
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
    }
}
