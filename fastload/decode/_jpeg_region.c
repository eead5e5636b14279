/*
 * Region decode of a JPEG through the libjpeg API of the libjpeg-turbo that Pillow loads.
 *
 * Pillow's wheels ship a libjpeg-turbo release (3.2 with Pillow 13) and update it with each
 * Pillow release; this module binds to that library at run time (`load(path)`: dlopen of the
 * file Pillow's _imaging links, dlsym of the few functions below), so fastload ships no JPEG
 * library of its own and never loads a pre-release one. It is compiled against the system's
 * jpeglib.h (the libjpeg 6.2 ABI every libjpeg-turbo keeps); jpeg_CreateDecompress checks
 * that the library and the header agree on the ABI version and the struct size, so a
 * mismatch is an error, not a crash.
 *
 * decode() writes the region's RGB rows straight into the caller's buffer: rows above the
 * region are skipped (entropy-decoded only: jpeg_skip_scanlines), rows below are never
 * read (jpeg_abort_decompress), columns outside it skip IDCT, upsampling and colour
 * conversion (jpeg_crop_scanline), and the image may be DCT-scaled by 1/2, 1/4 or 1/8 at the
 * same time. libjpeg's warnings ("Corrupt JPEG data: ...") end the decode as errors, so a
 * damaged file is never returned half-grey; nothing is printed. The GIL is released while
 * libjpeg runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <setjmp.h>
#include <stdio.h>
#include <string.h>

#include <jpeglib.h>

/* Pillow's libjpeg-turbo is built with the libjpeg 6.2 ABI (libjpeg.so.62); headers of the
 * 7/8 ABI (Ubuntu's libjpeg-turbo8-dev) describe another struct layout. Fail the (optional)
 * build rather than every decode. */
#if JPEG_LIB_VERSION != 62
#error "fastload's region decoder needs libjpeg 6.2 headers (Debian: libjpeg62-turbo-dev)"
#endif

static struct {
    __typeof__(jpeg_std_error) *std_error;
    __typeof__(jpeg_CreateDecompress) *create;
    __typeof__(jpeg_destroy_decompress) *destroy;
    __typeof__(jpeg_mem_src) *mem_src;
    __typeof__(jpeg_read_header) *read_header;
    __typeof__(jpeg_start_decompress) *start;
    __typeof__(jpeg_crop_scanline) *crop;
    __typeof__(jpeg_skip_scanlines) *skip;
    __typeof__(jpeg_read_scanlines) *read;
    __typeof__(jpeg_abort_decompress) *abort;
} lib;

static void *lib_handle = NULL;
static PyObject *RegionError = NULL;

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX + 16];
} ErrorTrap;

/* error_exit: libjpeg's default calls exit(); this one returns to decode_rows. */
static void on_error(j_common_ptr cinfo) {
    ErrorTrap *trap = (ErrorTrap *)cinfo->err;
    trap->pub.format_message(cinfo, trap->message);
    longjmp(trap->jump, 1);
}

/* emit_message: level < 0 is a warning about damaged data; end the decode there (the
 * default prints it to stderr and goes on). Trace messages (level >= 0) are dropped. */
static void on_message(j_common_ptr cinfo, int level) {
    if (level < 0) {
        ErrorTrap *trap = (ErrorTrap *)cinfo->err;
        trap->pub.format_message(cinfo, trap->message);
        longjmp(trap->jump, 1);
    }
}

typedef struct {
    const unsigned char *data;
    unsigned long size;
    unsigned char *out;
    Py_ssize_t capacity;
    int scale_denom, fastdct, fastupsample;
    JDIMENSION x0, y0, x1, y1; /* wanted region in the scaled image, x1/y1 exclusive */
    JDIMENSION x, y, w, h;     /* the region decoded (x aligned down to an iMCU) */
    JDIMENSION width, height;  /* the scaled image */
} Job;

/* Runs without the GIL. 0 on success; -1 with trap->message set. */
static int decode_rows(Job *job, ErrorTrap *trap) {
    struct jpeg_decompress_struct cinfo;
    /* volatile: read after a longjmp back into this frame */
    volatile int created = 0;
    cinfo.err = lib.std_error(&trap->pub);
    trap->pub.error_exit = on_error;
    trap->pub.emit_message = on_message;
    if (setjmp(trap->jump)) {
        if (created)
            lib.destroy(&cinfo);
        return -1;
    }
    lib.create(&cinfo, JPEG_LIB_VERSION, sizeof(cinfo));
    created = 1;
    lib.mem_src(&cinfo, job->data, job->size);
    lib.read_header(&cinfo, TRUE);
    if (cinfo.num_components != 1 && cinfo.num_components != 3) {
        snprintf(trap->message, sizeof(trap->message), "%d colour components",
                 cinfo.num_components);
        lib.destroy(&cinfo);
        return -1;
    }
    cinfo.out_color_space = JCS_RGB;
    cinfo.scale_num = 1;
    cinfo.scale_denom = (unsigned int)job->scale_denom;
    cinfo.dct_method = job->fastdct ? JDCT_IFAST : JDCT_ISLOW;
    cinfo.do_fancy_upsampling = job->fastupsample ? FALSE : TRUE;
    lib.start(&cinfo);
    job->width = cinfo.output_width;
    job->height = cinfo.output_height;
    if (job->x1 > cinfo.output_width)
        job->x1 = cinfo.output_width;
    if (job->y1 > cinfo.output_height)
        job->y1 = cinfo.output_height;
    if (job->x0 >= job->x1 || job->y0 >= job->y1) {
        snprintf(trap->message, sizeof(trap->message),
                 "region [%u, %u) x [%u, %u) outside the %ux%u image", job->x0, job->x1, job->y0,
                 job->y1, cinfo.output_width, cinfo.output_height);
        lib.abort(&cinfo);
        lib.destroy(&cinfo);
        return -1;
    }
    JDIMENSION x = job->x0, w = job->x1 - job->x0;
    if (w < cinfo.output_width)
        lib.crop(&cinfo, &x, &w); /* aligns x down to an iMCU, widens w to match */
    JDIMENSION h = job->y1 - job->y0;
    if ((Py_ssize_t)h * w * 3 > job->capacity) {
        snprintf(trap->message, sizeof(trap->message),
                 "region %ux%u at x=%u does not fit the %zd-byte buffer", w, h, x,
                 job->capacity);
        lib.abort(&cinfo);
        lib.destroy(&cinfo);
        return -1;
    }
    if (job->y0 > 0 && lib.skip(&cinfo, job->y0) != job->y0) {
        snprintf(trap->message, sizeof(trap->message), "could not skip to row %u", job->y0);
        lib.abort(&cinfo);
        lib.destroy(&cinfo);
        return -1;
    }
    JSAMPROW rows[16];
    JDIMENSION done = 0;
    while (done < h) {
        JDIMENSION n = h - done < 16 ? h - done : 16;
        for (JDIMENSION i = 0; i < n; i++)
            rows[i] = job->out + (size_t)(done + i) * w * 3;
        JDIMENSION got = lib.read(&cinfo, rows, n);
        if (got == 0) {
            snprintf(trap->message, sizeof(trap->message), "no data after row %u",
                     job->y0 + done);
            lib.abort(&cinfo);
            lib.destroy(&cinfo);
            return -1;
        }
        done += got;
    }
    lib.abort(&cinfo); /* the rows below the region are never decoded */
    lib.destroy(&cinfo);
    job->x = x;
    job->y = job->y0;
    job->w = w;
    job->h = h;
    return 0;
}

static PyObject *decode(PyObject *Py_UNUSED(self), PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"data",  "out",     "scale_denom", "x0",           "y0", "x1",
                               "y1",    "fastdct", "fastupsample", NULL};
    Py_buffer data, out;
    Job job;
    memset(&job, 0, sizeof(job));
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*w*iIIII|pp", keywords, &data, &out,
                                     &job.scale_denom, &job.x0, &job.y0, &job.x1, &job.y1,
                                     &job.fastdct, &job.fastupsample))
        return NULL;
    if (lib_handle == NULL) {
        PyBuffer_Release(&data);
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_RuntimeError, "no libjpeg loaded: call load(path) first");
        return NULL;
    }
    if (job.scale_denom != 1 && job.scale_denom != 2 && job.scale_denom != 4 &&
        job.scale_denom != 8) {
        PyBuffer_Release(&data);
        PyBuffer_Release(&out);
        PyErr_Format(PyExc_ValueError, "scale_denom=%d: use 1, 2, 4 or 8", job.scale_denom);
        return NULL;
    }
    job.data = data.buf;
    job.size = (unsigned long)data.len;
    job.out = out.buf;
    job.capacity = out.len;
    ErrorTrap trap;
    trap.message[0] = '\0';
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = decode_rows(&job, &trap);
    Py_END_ALLOW_THREADS PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    if (rc != 0) {
        PyErr_SetString(RegionError, trap.message);
        return NULL;
    }
    return Py_BuildValue("(IIIIII)", job.x, job.y, job.w, job.h, job.width, job.height);
}

#define BIND(field, symbol)                                                                   \
    do {                                                                                      \
        *(void **)(&lib.field) = dlsym(handle, symbol);                                       \
        if (lib.field == NULL) {                                                              \
            PyErr_Format(PyExc_ImportError, "%s has no %s", path, symbol);                    \
            dlclose(handle);                                                                  \
            return NULL;                                                                      \
        }                                                                                     \
    } while (0)

static PyObject *load(PyObject *Py_UNUSED(self), PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path))
        return NULL;
    if (lib_handle != NULL)
        Py_RETURN_NONE;
    void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (handle == NULL) {
        PyErr_Format(PyExc_ImportError, "dlopen(%s): %s", path, dlerror());
        return NULL;
    }
    BIND(std_error, "jpeg_std_error");
    BIND(create, "jpeg_CreateDecompress");
    BIND(destroy, "jpeg_destroy_decompress");
    BIND(mem_src, "jpeg_mem_src");
    BIND(read_header, "jpeg_read_header");
    BIND(start, "jpeg_start_decompress");
    BIND(crop, "jpeg_crop_scanline");
    BIND(skip, "jpeg_skip_scanlines");
    BIND(read, "jpeg_read_scanlines");
    BIND(abort, "jpeg_abort_decompress");
    lib_handle = handle;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"load", load, METH_VARARGS,
     "load(path): bind to the libjpeg (6.2 ABI) shared library at path; once per process."},
    {"decode", (PyCFunction)(void (*)(void))decode, METH_VARARGS | METH_KEYWORDS,
     "decode(data, out, scale_denom, x0, y0, x1, y1, fastdct=False, fastupsample=False)\n"
     "-> (x, y, w, h, width, height): decode rows [y0, y1) and columns from x0 (aligned\n"
     "down to an iMCU, returned as x) to x1 of the image scaled by 1/scale_denom (width x\n"
     "height), as packed RGB rows of w pixels into the writable buffer out. RegionError\n"
     "when libjpeg refuses the data."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_jpeg_region", "Region decode through libjpeg's API.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__jpeg_region(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    RegionError = PyErr_NewException("_jpeg_region.RegionError", PyExc_ValueError, NULL);
    if (RegionError == NULL || PyModule_AddObject(m, "RegionError", RegionError) < 0) {
        Py_XDECREF(RegionError);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(RegionError);
    PyModule_AddIntConstant(m, "JPEG_LIB_VERSION", JPEG_LIB_VERSION);
    return m;
}
