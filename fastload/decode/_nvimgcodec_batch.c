/*
 * backend=nvjpeg's batched decode through nvImageCodec's C API, with the GIL released from
 * the first code stream to the last status.
 *
 * nvImageCodec's Python binding takes the GIL back once per image of a batch (to wrap each
 * output image) and fastload made one Python CodeStream per image: ~500 GIL hand-offs and
 * ~1-2 ms of Python per 256-image batch, all in the prep thread, while a launch-bound training
 * thread waits for the same GIL between its kernel launches. Here one call does the batch:
 * it parses the code streams, points an image at each canvas slot, decodes, waits and reads
 * the statuses without touching a Python object, and returns one byte per image.
 *
 * Like _jpeg_region.c it brings no library of its own: `load(path)` binds (dlopen/dlsym) to
 * the libnvimgcodec.so.0 that the nvidia-nvimgcodec wheel installed and Python's binding has
 * already loaded (with the nvJPEG libraries its extensions need). It is compiled against
 * that wheel's nvimgcodec.h (a build requirement, see setup.py); the structures carry their
 * own size, which the library checks. Code streams and images are made once per slot and
 * reused batch after batch (the API's documented reuse of a non-NULL handle).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

#include <nvimgcodec.h>

static struct {
    __typeof__(nvimgcodecGetProperties) *get_properties;
    __typeof__(nvimgcodecInstanceCreate) *instance_create;
    __typeof__(nvimgcodecDecoderCreate) *decoder_create;
    __typeof__(nvimgcodecDecoderDestroy) *decoder_destroy;
    __typeof__(nvimgcodecDecoderDecode) *decode;
    __typeof__(nvimgcodecCodeStreamCreateFromHostMem) *stream_from_host;
    __typeof__(nvimgcodecCodeStreamDestroy) *stream_destroy;
    __typeof__(nvimgcodecCodeStreamGetImageInfo) *stream_info;
    __typeof__(nvimgcodecImageCreate) *image_create;
    __typeof__(nvimgcodecImageDestroy) *image_destroy;
    __typeof__(nvimgcodecFutureWaitForAll) *future_wait;
    __typeof__(nvimgcodecFutureGetProcessingStatus) *future_status;
    __typeof__(nvimgcodecFutureDestroy) *future_destroy;
} lib;

static nvimgcodecInstance_t instance = NULL; /* one per process, never destroyed */

/* Refusal reasons, one byte per image in decode()'s result. */
enum { DECODED = 0, REFUSED_PARSE = 1, REFUSED_SLOT = 2, REFUSED_DECODE = 3 };

typedef struct {
    PyObject_HEAD nvimgcodecDecoder_t decoder;
    int on_device;
    Py_ssize_t capacity;
    nvimgcodecCodeStream_t *streams; /* per slot, reused */
    nvimgcodecImage_t *images;       /* per slot, reused */
    nvimgcodecCodeStream_t *batch_streams;
    nvimgcodecImage_t *batch_images;
    Py_ssize_t *batch_slot;
    nvimgcodecProcessingStatus_t *statuses;
} Decoder;

static void decoder_dealloc(Decoder *self) {
    for (Py_ssize_t k = 0; k < self->capacity; k++) {
        if (self->images[k] != NULL)
            lib.image_destroy(self->images[k]);
        if (self->streams[k] != NULL)
            lib.stream_destroy(self->streams[k]);
    }
    if (self->decoder != NULL)
        lib.decoder_destroy(self->decoder);
    PyMem_Free(self->streams);
    PyMem_Free(self->images);
    PyMem_Free(self->batch_streams);
    PyMem_Free(self->batch_images);
    PyMem_Free(self->batch_slot);
    PyMem_Free(self->statuses);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Decoder(device_id, max_cpu_threads, backends, options): backends is a sequence of
 * (kind, load_hint) pairs, nvimgcodecBackendKind_t values, in priority order. */
static int decoder_init(Decoder *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"device_id", "max_cpu_threads", "backends", "options", NULL};
    int device_id, threads;
    PyObject *backends_arg;
    const char *options;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iiOs", keywords, &device_id, &threads,
                                     &backends_arg, &options))
        return -1;
    if (instance == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "load(path) first");
        return -1;
    }
    PyObject *seq = PySequence_Fast(backends_arg, "backends: a sequence of (kind, load_hint)");
    if (seq == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    nvimgcodecBackend_t backends[8];
    if (n < 1 || n > 8) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "backends: 1 to 8 (kind, load_hint) pairs");
        return -1;
    }
    self->on_device = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int kind;
        float hint;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "if", &kind, &hint)) {
            Py_DECREF(seq);
            return -1;
        }
        memset(&backends[i], 0, sizeof(backends[i]));
        backends[i].struct_type = NVIMGCODEC_STRUCTURE_TYPE_BACKEND;
        backends[i].struct_size = sizeof(nvimgcodecBackend_t);
        backends[i].kind = (nvimgcodecBackendKind_t)kind;
        backends[i].params.struct_type = NVIMGCODEC_STRUCTURE_TYPE_BACKEND_PARAMS;
        backends[i].params.struct_size = sizeof(nvimgcodecBackendParams_t);
        backends[i].params.load_hint = hint;
        backends[i].params.load_hint_policy = NVIMGCODEC_LOAD_HINT_POLICY_FIXED;
        if (kind != NVIMGCODEC_BACKEND_KIND_CPU_ONLY)
            self->on_device = 1;
    }
    Py_DECREF(seq);
    nvimgcodecExecutionParams_t exec;
    memset(&exec, 0, sizeof(exec));
    exec.struct_type = NVIMGCODEC_STRUCTURE_TYPE_EXECUTION_PARAMS;
    exec.struct_size = sizeof(exec);
    exec.max_num_cpu_threads = threads;
    exec.device_id = device_id;
    exec.num_backends = (int)n;
    exec.backends = backends;
    nvimgcodecStatus_t rc;
    Py_BEGIN_ALLOW_THREADS rc = lib.decoder_create(instance, &self->decoder, &exec, options);
    Py_END_ALLOW_THREADS if (rc != NVIMGCODEC_STATUS_SUCCESS) {
        self->decoder = NULL;
        PyErr_Format(PyExc_RuntimeError, "nvimgcodecDecoderCreate failed (status %d)", (int)rc);
        return -1;
    }
    return 0;
}

static int grow(Decoder *self, Py_ssize_t n) {
    if (n <= self->capacity)
        return 0;
#define GROW(field, type)                                                                     \
    do {                                                                                      \
        type *p = PyMem_Realloc(self->field, n * sizeof(type));                               \
        if (p == NULL)                                                                        \
            return -1;                                                                        \
        self->field = p;                                                                      \
    } while (0)
    GROW(streams, nvimgcodecCodeStream_t);
    GROW(images, nvimgcodecImage_t);
    GROW(batch_streams, nvimgcodecCodeStream_t);
    GROW(batch_images, nvimgcodecImage_t);
    GROW(batch_slot, Py_ssize_t);
    GROW(statuses, nvimgcodecProcessingStatus_t);
#undef GROW
    for (Py_ssize_t k = self->capacity; k < n; k++)
        self->streams[k] = NULL, self->images[k] = NULL;
    self->capacity = n;
    return 0;
}

typedef struct {
    const unsigned char *data;
    const int64_t *offsets;
    Py_ssize_t n;
    unsigned char *canvas;
    size_t slot_bytes, row_stride;
    uint32_t slot_height, slot_width;
    cudaStream_t stream;
    unsigned char *result;
} Batch;

/* One image's output description: interleaved 8-bit RGB at the top-left of its slot. */
static void describe_output(nvimgcodecImageInfo_t *info, Decoder *self, const Batch *b,
                            Py_ssize_t k) {
    uint32_t width = info->plane_info[0].width, height = info->plane_info[0].height;
    info->color_spec = NVIMGCODEC_COLORSPEC_SRGB;
    info->chroma_subsampling = NVIMGCODEC_SAMPLING_NONE;
    info->sample_format = NVIMGCODEC_SAMPLEFORMAT_I_RGB;
    info->num_planes = 1;
    info->plane_info[0].width = width;
    info->plane_info[0].height = height;
    info->plane_info[0].row_stride = b->row_stride;
    info->plane_info[0].num_channels = 3;
    info->plane_info[0].sample_type = NVIMGCODEC_SAMPLE_DATA_TYPE_UINT8;
    info->plane_info[0].precision = 0;
    info->buffer = b->canvas + (size_t)k * b->slot_bytes;
    info->buffer_kind = self->on_device ? NVIMGCODEC_IMAGE_BUFFER_KIND_STRIDED_DEVICE
                                        : NVIMGCODEC_IMAGE_BUFFER_KIND_STRIDED_HOST;
    info->cuda_stream = b->stream;
}

/* Runs without the GIL. Returns the library status of the decode call itself. */
static nvimgcodecStatus_t decode_batch(Decoder *self, Batch *b) {
    Py_ssize_t m = 0;
    for (Py_ssize_t k = 0; k < b->n; k++) {
        b->result[k] = REFUSED_PARSE;
        size_t length = (size_t)(b->offsets[k + 1] - b->offsets[k]);
        if (lib.stream_from_host(instance, &self->streams[k], b->data + b->offsets[k], length,
                                 NULL) != NVIMGCODEC_STATUS_SUCCESS) {
            if (self->streams[k] != NULL) /* a failed reuse: start afresh next time */
                lib.stream_destroy(self->streams[k]);
            self->streams[k] = NULL;
            continue;
        }
        nvimgcodecImageInfo_t info;
        memset(&info, 0, sizeof(info));
        info.struct_type = NVIMGCODEC_STRUCTURE_TYPE_IMAGE_INFO;
        info.struct_size = sizeof(info);
        if (lib.stream_info(self->streams[k], &info) != NVIMGCODEC_STATUS_SUCCESS)
            continue;
        if (info.plane_info[0].width > b->slot_width ||
            info.plane_info[0].height > b->slot_height) {
            b->result[k] = REFUSED_SLOT;
            continue;
        }
        describe_output(&info, self, b, k);
        if (lib.image_create(instance, &self->images[k], &info) != NVIMGCODEC_STATUS_SUCCESS) {
            b->result[k] = REFUSED_DECODE;
            continue;
        }
        self->batch_streams[m] = self->streams[k];
        self->batch_images[m] = self->images[k];
        self->batch_slot[m++] = k;
    }
    if (m == 0)
        return NVIMGCODEC_STATUS_SUCCESS;
    nvimgcodecDecodeParams_t params;
    memset(&params, 0, sizeof(params));
    params.struct_type = NVIMGCODEC_STRUCTURE_TYPE_DECODE_PARAMS;
    params.struct_size = sizeof(params);
    params.apply_exif_orientation = 0; /* boxes are drawn on the stored pixels */
    nvimgcodecFuture_t future = NULL;
    nvimgcodecStatus_t rc = lib.decode(self->decoder, self->batch_streams, self->batch_images,
                                       (int)m, &params, &future);
    size_t got = 0;
    if (rc == NVIMGCODEC_STATUS_SUCCESS)
        rc = lib.future_wait(future);
    if (rc == NVIMGCODEC_STATUS_SUCCESS)
        rc = lib.future_status(future, self->statuses, &got);
    if (future != NULL)
        lib.future_destroy(future);
    for (Py_ssize_t i = 0; i < m; i++) {
        int ok = rc == NVIMGCODEC_STATUS_SUCCESS && (size_t)i < got &&
                 self->statuses[i] == NVIMGCODEC_PROCESSING_STATUS_SUCCESS;
        b->result[self->batch_slot[i]] = ok ? DECODED : REFUSED_DECODE;
    }
    return rc;
}

static int read_buffer(PyObject *obj, Py_buffer *view, const char *name, int writable) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    (void)name;
    return 0;
}

/* decode(data, offsets, canvas, slot_bytes, row_stride, slot_height, slot_width, stream)
 * -> bytes: one code per image (0 decoded, 1 unparsable, 2 larger than its slot, 3 refused
 * by the decoder). */
static PyObject *decoder_decode(Decoder *self, PyObject *args) {
    PyObject *data_obj, *offsets_obj;
    unsigned long long canvas, stream;
    Py_ssize_t slot_bytes, row_stride;
    unsigned int slot_height, slot_width;
    if (!PyArg_ParseTuple(args, "OOKnnIIK", &data_obj, &offsets_obj, &canvas, &slot_bytes,
                          &row_stride, &slot_height, &slot_width, &stream))
        return NULL;
    Py_buffer data, offsets;
    if (read_buffer(data_obj, &data, "data", 0) < 0)
        return NULL;
    if (read_buffer(offsets_obj, &offsets, "offsets", 0) < 0) {
        PyBuffer_Release(&data);
        return NULL;
    }
    Py_ssize_t n = offsets.len / (Py_ssize_t)sizeof(int64_t) - 1;
    const int64_t *off = offsets.buf;
    int bad = offsets.itemsize != (Py_ssize_t)sizeof(int64_t) || n < 0;
    for (Py_ssize_t k = 0; !bad && k < n; k++)
        bad = off[k] < 0 || off[k + 1] < off[k] || off[k + 1] > data.len;
    PyObject *result = NULL;
    if (bad)
        PyErr_SetString(PyExc_ValueError, "offsets: n + 1 ascending int64 positions in data");
    else if (slot_bytes < row_stride || row_stride < 3 * (Py_ssize_t)slot_width ||
             slot_bytes < row_stride * (Py_ssize_t)slot_height)
        PyErr_SetString(PyExc_ValueError, "slot_bytes/row_stride smaller than a slot's pixels");
    else if (grow(self, n) < 0)
        PyErr_NoMemory();
    else
        result = PyBytes_FromStringAndSize(NULL, n);
    if (result != NULL && n > 0) {
        Batch b = {data.buf, off, n, (unsigned char *)(uintptr_t)canvas, (size_t)slot_bytes,
                   (size_t)row_stride, slot_height, slot_width, (cudaStream_t)(uintptr_t)stream,
                   (unsigned char *)PyBytes_AS_STRING(result)};
        Py_BEGIN_ALLOW_THREADS decode_batch(self, &b);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&offsets);
    return result;
}

static PyMethodDef decoder_methods[] = {
    {"decode", (PyCFunction)decoder_decode, METH_VARARGS,
     "decode(data, offsets, canvas, slot_bytes, row_stride, slot_height, slot_width, stream)\n"
     "-> bytes: decodes images data[offsets[k]:offsets[k+1]] as RGB into slot k of the canvas\n"
     "at address `canvas` (device memory for a GPU decoder, host memory for a CPU one): top-left\n"
     "of the slot, rows `row_stride` bytes apart, slots `slot_bytes` apart, on CUDA stream\n"
     "`stream`; returns once decoded. One code per image: 0 decoded, 1 unparsable, 2 larger\n"
     "than its slot, 3 refused by the decoder. The GIL is released throughout."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject DecoderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_nvimgcodec_batch.Decoder",
    .tp_basicsize = sizeof(Decoder),
    .tp_dealloc = (destructor)decoder_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Decoder(device_id, max_cpu_threads, backends, options): a batched nvImageCodec "
              "decoder; backends: (kind, load_hint) pairs in priority order.",
    .tp_methods = decoder_methods,
    .tp_init = (initproc)decoder_init,
    .tp_new = PyType_GenericNew,
};

#define BIND(field, symbol)                                                                   \
    do {                                                                                      \
        *(void **)(&lib.field) = dlsym(handle, symbol);                                       \
        if (lib.field == NULL) {                                                              \
            PyErr_Format(PyExc_ImportError, "%s has no %s", path, symbol);                    \
            return NULL;                                                                      \
        }                                                                                     \
    } while (0)

static PyObject *load(PyObject *Py_UNUSED(self), PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path))
        return NULL;
    if (instance != NULL)
        Py_RETURN_NONE;
    void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (handle == NULL) {
        PyErr_Format(PyExc_ImportError, "dlopen(%s): %s", path, dlerror());
        return NULL;
    }
    BIND(get_properties, "nvimgcodecGetProperties");
    BIND(instance_create, "nvimgcodecInstanceCreate");
    BIND(decoder_create, "nvimgcodecDecoderCreate");
    BIND(decoder_destroy, "nvimgcodecDecoderDestroy");
    BIND(decode, "nvimgcodecDecoderDecode");
    BIND(stream_from_host, "nvimgcodecCodeStreamCreateFromHostMem");
    BIND(stream_destroy, "nvimgcodecCodeStreamDestroy");
    BIND(stream_info, "nvimgcodecCodeStreamGetImageInfo");
    BIND(image_create, "nvimgcodecImageCreate");
    BIND(image_destroy, "nvimgcodecImageDestroy");
    BIND(future_wait, "nvimgcodecFutureWaitForAll");
    BIND(future_status, "nvimgcodecFutureGetProcessingStatus");
    BIND(future_destroy, "nvimgcodecFutureDestroy");
    nvimgcodecProperties_t props;
    memset(&props, 0, sizeof(props));
    props.struct_type = NVIMGCODEC_STRUCTURE_TYPE_PROPERTIES;
    props.struct_size = sizeof(props);
    if (lib.get_properties(&props) != NVIMGCODEC_STATUS_SUCCESS ||
        props.version / 100 != NVIMGCODEC_VER / 100) {
        PyErr_Format(PyExc_ImportError, "%s is nvImageCodec %u, built against %u", path,
                     props.version, (unsigned)NVIMGCODEC_VER);
        return NULL;
    }
    nvimgcodecInstanceCreateInfo_t create;
    memset(&create, 0, sizeof(create));
    create.struct_type = NVIMGCODEC_STRUCTURE_TYPE_INSTANCE_CREATE_INFO;
    create.struct_size = sizeof(create);
    create.load_builtin_modules = 1;
    create.load_extension_modules = 1; /* from the extensions/ folder beside the library */
    nvimgcodecStatus_t rc = lib.instance_create(&instance, &create);
    if (rc != NVIMGCODEC_STATUS_SUCCESS) {
        instance = NULL;
        PyErr_Format(PyExc_ImportError, "nvimgcodecInstanceCreate failed (status %d)", (int)rc);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"load", load, METH_VARARGS,
     "load(path): bind to nvImageCodec's libnvimgcodec.so.0 at path and make this process's\n"
     "library instance; once per process."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_nvimgcodec_batch",
    "Batched nvImageCodec decode into canvas slots, the GIL released.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__nvimgcodec_batch(void) {
    if (PyType_Ready(&DecoderType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&DecoderType);
    if (PyModule_AddObject(m, "Decoder", (PyObject *)&DecoderType) < 0) {
        Py_DECREF(&DecoderType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
