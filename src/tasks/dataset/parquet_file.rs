//! Parquet datasets, read through the `parquet` crate's row API (no Arrow): only the
//! columns an item uses are decoded (the prompt or messages column, the answer, `verifier`,
//! and the text columns the meta carries), so a file with image or embedding columns costs
//! what its text does.

use super::{Columns, Dataset, DatasetError, DatasetItem, Unit, row_item};
use crate::tasks::item::VERIFIER;
use ::parquet::basic::{ConvertedType, LogicalType, Type as Physical};
use ::parquet::file::reader::{FileReader, SerializedFileReader};
use ::parquet::schema::types::{Type, TypePtr};

/// The first (and last) four bytes of every Parquet file.
pub(super) const MAGIC: &[u8] = b"PAR1";

/// Whether a top-level column holds text (UTF-8 byte arrays).
fn is_text(t: &Type) -> bool {
    if !t.is_primitive() || t.get_physical_type() != Physical::BYTE_ARRAY {
        return false;
    }
    let info = t.get_basic_info();
    matches!(
        info.logical_type_ref(),
        Some(LogicalType::String | LogicalType::Enum | LogicalType::Json)
    ) || matches!(
        info.converted_type(),
        ConvertedType::UTF8 | ConvertedType::ENUM | ConvertedType::JSON
    )
}

/// The projection an item reads: the prompt column when the file has one (else the
/// messages column), the answer, `verifier` and every text column, in the file's order.
fn projection(fields: &[TypePtr], root: &str, cols: &Columns) -> Result<Type, String> {
    let find = |n: &str| fields.iter().find(|f| f.name() == n);
    let present = || {
        fields
            .iter()
            .map(|f| f.name().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let (source, unused) = match (find(&cols.prompt), find(&cols.messages)) {
        (Some(p), _) => (p, &cols.messages),
        (None, Some(m)) => (m, &cols.prompt),
        (None, None) => {
            return Err(format!(
                "no `{}` or `{}` column (its columns: {}): name the prompt column with \
                 --prompt-column or the conversation column with --messages-column",
                cols.prompt,
                cols.messages,
                present()
            ));
        }
    };
    let Some(answer) = find(&cols.answer) else {
        return Err(format!(
            "no `{}` column (its columns: {}): name the answer column with --answer-column",
            cols.answer,
            present()
        ));
    };
    for col in [source, answer] {
        if col.is_primitive() && !is_text(col) && col.get_physical_type() == Physical::BYTE_ARRAY {
            return Err(format!(
                "column `{}` holds binary values, not text",
                col.name()
            ));
        }
    }
    let wanted: Vec<TypePtr> = fields
        .iter()
        .filter(|f| {
            let n = f.name();
            (n == source.name() || n == answer.name() || n == VERIFIER || is_text(f))
                && n != unused.as_str()
        })
        .cloned()
        .collect();
    Type::group_type_builder(root)
        .with_fields(wanted)
        .build()
        .map_err(|e| format!("cannot select its columns: {e}"))
}

/// What to do about a codec this build does not read.
fn codec_hint(e: &::parquet::errors::ParquetError) -> &'static str {
    if e.to_string().contains("Disabled feature") {
        " (rlstream reads uncompressed, snappy, zstd, gzip and lz4 Parquet: rewrite the file \
         with one of those, e.g. pyarrow's `pq.write_table(table, path, compression=\"zstd\")`)"
    } else {
        ""
    }
}

pub(super) fn load(
    bytes: bytes::Bytes,
    path: &str,
    name: String,
    cols: &Columns,
) -> Result<Dataset, DatasetError> {
    let bad = |reason: String| DatasetError::File {
        path: path.to_string(),
        reason,
    };
    let reader = SerializedFileReader::new(bytes)
        .map_err(|e| bad(format!("not a readable Parquet file: {e}")))?;
    let schema = reader.metadata().file_metadata().schema_descr();
    let root = schema.root_schema();
    let projection = projection(root.get_fields(), root.name(), cols).map_err(bad)?;
    let rows = reader
        .get_row_iter(Some(projection))
        .map_err(|e| bad(format!("cannot read its rows: {e}")))?;
    let mut d = Dataset {
        name,
        items: Vec::new(),
        unit: Unit::Row,
        rows: 0,
        skipped: Vec::new(),
    };
    for (n, row) in rows.enumerate() {
        let row = row.map_err(|e| bad(format!("row {n} cannot be read: {e}{}", codec_hint(&e))))?;
        d.rows += 1;
        let serde_json::Value::Object(obj) = row.to_json_value() else {
            d.skipped.push((n, "not a record".into()));
            continue;
        };
        match row_item(&obj, cols) {
            Ok((item, chat)) => d.items.push(DatasetItem {
                line: n,
                item,
                chat,
            }),
            Err(why) => d.skipped.push((n, why)),
        }
    }
    Ok(d)
}
