//! `replay --reward`: a comparison on the mean reward of a group.

/// A comparison on the mean reward of a group (`--reward '<0.5'`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RewardFilter {
    op: Cmp,
    value: f64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Cmp {
    Lt,
    Le,
    Gt,
    Ge,
    Eq,
}

impl std::str::FromStr for RewardFilter {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let (op, rest) = if let Some(r) = s.strip_prefix("<=") {
            (Cmp::Le, r)
        } else if let Some(r) = s.strip_prefix(">=") {
            (Cmp::Ge, r)
        } else if let Some(r) = s.strip_prefix('<') {
            (Cmp::Lt, r)
        } else if let Some(r) = s.strip_prefix('>') {
            (Cmp::Gt, r)
        } else if let Some(r) = s.strip_prefix('=') {
            (Cmp::Eq, r)
        } else {
            (Cmp::Eq, s)
        };
        let value: f64 = rest
            .trim()
            .parse()
            .map_err(|_| format!("`{s}` is not a reward test like <0.5, >=0.9 or =1"))?;
        Ok(RewardFilter { op, value })
    }
}

impl RewardFilter {
    pub(super) fn keeps(&self, r: f64) -> bool {
        match self.op {
            Cmp::Lt => r < self.value,
            Cmp::Le => r <= self.value,
            Cmp::Gt => r > self.value,
            Cmp::Ge => r >= self.value,
            Cmp::Eq => r == self.value,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reward_tests_parse() {
        let f = |s: &str| s.parse::<RewardFilter>();
        assert!(f("<0.5").is_ok_and(|r| r.keeps(0.4) && !r.keeps(0.5)));
        assert!(f("<=0.5").is_ok_and(|r| r.keeps(0.5)));
        assert!(f(">0.9").is_ok_and(|r| r.keeps(1.0) && !r.keeps(0.9)));
        assert!(f(">= 1").is_ok_and(|r| r.keeps(1.0)));
        assert!(f("1").is_ok_and(|r| r.keeps(1.0) && !r.keeps(0.99)));
        assert!(f("<x").is_err() && f("").is_err());
    }
}
