//! Every common type, in typed JSON and in raw text, with its field metadata.

use nthbouncer_sqlhttp::WireOptions;
use serde_json::{json, Value};

use crate::support::*;

/// One column per type. Run in a batch after `SET LOCAL TimeZone` so timestamptz prints the same
/// whatever the server's zone.
const SELECT_ALL: &str = "SELECT 1::int2 AS i2, (-2147483648)::int4 AS i4, \
    9007199254740993::int8 AS i8, 12.3400::numeric AS num, 1.5::float4 AS f4, \
    2.25::float8 AS f8, 'NaN'::float8 AS nan, '-Infinity'::float4 AS ninf, true AS yes, \
    false AS no, 'héllo \"q\" \\ ' || chr(10) AS txt, 'x'::varchar(5) AS vc, \
    '\\xdeadbeef'::bytea AS bin, '2024-02-29'::date AS d, '13:14:15.5'::time AS t, \
    '2024-02-29 13:14:15.5+02'::timestamptz AS tstz, '2024-02-29 13:14:15'::timestamp AS ts, \
    '1 day 02:03:04'::interval AS iv, 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'::uuid AS id, \
    '{\"a\": [1, 2.50]}'::json AS js, '{\"b\": null, \"a\": 1}'::jsonb AS jb, \
    ARRAY[1, NULL, 3]::int4[] AS ia, ARRAY['a', 'b c', NULL, 'NULL']::text[] AS ta, \
    ARRAY[[true, false], [false, true]] AS ba, ARRAY[1.5, 'NaN']::float8[] AS fa, \
    ARRAY[1, 2]::int8[] AS la, ARRAY['{\"k\": 1}']::jsonb[] AS ja, '{}'::int4[] AS empty, \
    NULL::int4 AS nothing";

async fn select_all(options: WireOptions) -> Value {
    let app = unique("types");
    let db = database(&app, quick_limits(1)).await;
    let answer = run_batch(
        &db,
        json!([{"query": "SET LOCAL TimeZone TO 'UTC'"}, {"query": SELECT_ALL}]),
        options,
    )
    .await
    .unwrap();
    answer["results"][1].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_json_keeps_precision_and_natural_json() {
    let result = select_all(WireOptions::default()).await;
    let row = &result["rows"][0];
    let expected = json!({
        "i2": 1, "i4": -2147483648i64, "i8": "9007199254740993", "num": "12.3400",
        "f4": 1.5, "f8": 2.25, "nan": "NaN", "ninf": "-Infinity", "yes": true, "no": false,
        "txt": "héllo \"q\" \\ \n", "vc": "x", "bin": "\\xdeadbeef", "d": "2024-02-29",
        "t": "13:14:15.5", "tstz": "2024-02-29 11:14:15.5+00", "ts": "2024-02-29 13:14:15",
        "iv": "1 day 02:03:04", "id": "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
        "js": {"a": [1, 2.50]}, "jb": {"a": 1, "b": null},
        "ia": [1, null, 3], "ta": ["a", "b c", null, "NULL"],
        "ba": [[true, false], [false, true]], "fa": [1.5, "NaN"], "la": ["1", "2"],
        "ja": [{"k": 1}], "empty": [], "nothing": null,
    });
    assert_eq!(row, &expected);
    assert_eq!(result["rowAsArray"], json!(false));
    assert_eq!(result["command"], json!("SELECT"));
    assert_eq!(result["rowCount"], json!(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_text_is_postgres_text_for_every_type() {
    let result = select_all(raw_text()).await;
    let row = result["rows"][0].as_array().unwrap();
    let expected = json!([
        "1",
        "-2147483648",
        "9007199254740993",
        "12.3400",
        "1.5",
        "2.25",
        "NaN",
        "-Infinity",
        "t",
        "f",
        "héllo \"q\" \\ \n",
        "x",
        "\\xdeadbeef",
        "2024-02-29",
        "13:14:15.5",
        "2024-02-29 11:14:15.5+00",
        "2024-02-29 13:14:15",
        "1 day 02:03:04",
        "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
        "{\"a\": [1, 2.50]}",
        "{\"a\": 1, \"b\": null}",
        "{1,NULL,3}",
        "{a,\"b c\",NULL,\"NULL\"}",
        "{{t,f},{f,t}}",
        "{1.5,NaN}",
        "{1,2}",
        "{\"{\\\"k\\\": 1}\"}",
        "{}",
        null,
    ]);
    assert_eq!(&Value::Array(row.clone()), &expected);
    assert_eq!(result["rowAsArray"], json!(true));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fields_carry_neon_metadata() {
    let result = select_all(WireOptions::default()).await;
    let fields = result["fields"].as_array().unwrap();
    let by_name = |name: &str| fields.iter().find(|f| f["name"] == name).unwrap().clone();
    let ids: Vec<(&str, i64, i64)> = vec![
        ("i2", 21, 2),
        ("i4", 23, 4),
        ("i8", 20, 8),
        ("num", 1700, -1),
        ("f4", 700, 4),
        ("f8", 701, 8),
        ("yes", 16, 1),
        ("txt", 25, -1),
        ("bin", 17, -1),
        ("d", 1082, 4),
        ("tstz", 1184, 8),
        ("iv", 1186, 16),
        ("id", 2950, 16),
        ("js", 114, -1),
        ("jb", 3802, -1),
        ("ia", 1007, -1),
        ("ta", 1009, -1),
    ];
    for (name, oid, size) in ids {
        let f = by_name(name);
        assert_eq!(f["dataTypeID"], json!(oid), "{name}");
        assert_eq!(f["dataTypeSize"], json!(size), "{name}");
        assert_eq!(f["format"], json!("text"), "{name}");
        assert_eq!(f["tableID"], json!(0), "{name}: not from a table");
    }
    // varchar(5): the modifier is the length plus the 4-byte header.
    assert_eq!(by_name("vc")["dataTypeModifier"], json!(9));
    assert_eq!(by_name("i4")["dataTypeModifier"], json!(-1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_columns_name_their_table() {
    let schema = Schema::new("tablecols").await;
    let app = unique("tablecols");
    let db = database(&app, quick_limits(1)).await;
    let s = &schema.name;
    rows(
        &db,
        &format!("CREATE TABLE {s}.t (id int4 PRIMARY KEY, label varchar(10))"),
    )
    .await;
    rows(&db, &format!("INSERT INTO {s}.t VALUES (1, 'one')")).await;
    let oid = rows(&db, &format!("SELECT '{s}.t'::regclass::oid::int8 AS oid")).await[0]["oid"]
        .as_str()
        .unwrap()
        .parse::<i64>()
        .unwrap();
    let answer = run(
        &db,
        &format!("SELECT label, id FROM {s}.t"),
        json!([]),
        array_mode(),
    )
    .await
    .unwrap();
    assert_eq!(answer["rows"], json!([["one", 1]]));
    let fields = &answer["fields"];
    assert_eq!(fields[0]["name"], json!("label"));
    assert_eq!(fields[0]["tableID"], json!(oid));
    assert_eq!(fields[0]["columnID"], json!(2));
    assert_eq!(fields[0]["dataTypeModifier"], json!(14));
    assert_eq!(fields[1]["columnID"], json!(1));
    schema.drop_now().await;
}
